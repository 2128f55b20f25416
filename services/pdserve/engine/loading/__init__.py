"""pdserve.engine.loading"""
