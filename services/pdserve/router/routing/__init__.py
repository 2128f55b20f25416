"""pdserve.router.routing"""
