"""splitserve.kv_transfer"""
