"""`pdserve serve` hands its router the API key settings: keys in the router's environment,
never on a command line; the keys file and --protect-metrics as flags; no key to a worker."""
from pdserve.serve.launcher import child_stages
from pdserve.serve.settings import resolve_serve_settings


def test_the_router_gets_the_keys_in_its_environment_and_workers_get_none() -> None:
    settings = resolve_serve_settings(["--aggregated", "--api-keys-file", "/etc/pdserve/keys", "--protect-metrics"],
                                      {"PDSERVE_API_KEY": "s3cret-a,s3cret-b"})
    (worker,), (router,) = child_stages(settings)
    assert router.env is not None and router.env["PDSERVE_API_KEY"] == "s3cret-a,s3cret-b"
    assert not any("s3cret" in arg for arg in router.argv)
    flags = router.argv[router.argv.index("router") + 1:]
    assert flags[flags.index("--api-keys-file") + 1] == "/etc/pdserve/keys"
    assert "--protect-metrics" in flags
    assert worker.env is not None and "PDSERVE_API_KEY" not in worker.env
    assert not any("s3cret" in arg or "api-key" in arg for arg in worker.argv)
