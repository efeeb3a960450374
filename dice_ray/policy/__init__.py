"""dice_ray.policy"""
