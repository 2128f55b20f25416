"""pdserve.serve"""
