"""splitserve.engine"""
