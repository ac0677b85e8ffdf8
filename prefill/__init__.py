"""splitserve.prefill"""
