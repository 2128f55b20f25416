"""pdserve.engine.core"""
