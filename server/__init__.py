"""splitserve.server"""
