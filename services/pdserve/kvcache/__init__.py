"""pdserve.kvcache"""
