"""pdserve.bench"""
