"""splitserve.lang"""
