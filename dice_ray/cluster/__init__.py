"""dice_ray.cluster"""
