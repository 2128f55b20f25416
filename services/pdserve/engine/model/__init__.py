"""pdserve.engine.model.decoder"""
