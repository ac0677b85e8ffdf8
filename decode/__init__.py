"""splitserve.decode"""
