"""splitserve.radix_cache"""
