"""dice_ray.rl"""
