"""pdserve.rpc"""
