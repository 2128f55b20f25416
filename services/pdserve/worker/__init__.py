"""pdserve.worker"""
