"""pdserve.router.openai"""
