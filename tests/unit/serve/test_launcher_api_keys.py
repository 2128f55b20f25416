"""`pdserve serve` hands its router the API key settings: keys in the router's environment,
never on a command line; the keys file and --protect-metrics as flags. A worker gets the keys
(the same way) only with --protect-metrics, which guards its metrics port too."""
from pdserve.serve.launcher import child_stages
from pdserve.serve.settings import resolve_serve_settings

KEYS = {"PDSERVE_API_KEY": "s3cret-a,s3cret-b"}


def test_the_router_gets_the_keys_in_its_environment_and_workers_get_none() -> None:
    settings = resolve_serve_settings(["--aggregated", "--api-keys-file", "/etc/pdserve/keys"], KEYS)
    (worker,), (router,) = child_stages(settings)
    assert router.env is not None and router.env["PDSERVE_API_KEY"] == "s3cret-a,s3cret-b"
    assert not any("s3cret" in arg for arg in router.argv)
    flags = router.argv[router.argv.index("router") + 1:]
    assert flags[flags.index("--api-keys-file") + 1] == "/etc/pdserve/keys"
    assert worker.env is not None and "PDSERVE_API_KEY" not in worker.env
    assert not any("s3cret" in arg or "/etc/pdserve/keys" in arg for arg in worker.argv)


def test_with_protect_metrics_every_worker_gets_the_keys_the_same_way() -> None:
    settings = resolve_serve_settings(["--prefill", "1", "--decode", "1", "--api-keys-file", "/etc/pdserve/keys",
                                       "--protect-metrics"], KEYS)
    workers, (router,) = child_stages(settings)
    assert "--protect-metrics" in router.argv
    for worker in workers:
        assert worker.env is not None and worker.env["PDSERVE_API_KEY"] == "s3cret-a,s3cret-b"
        assert not any("s3cret" in arg for arg in worker.argv)
        flags = worker.argv[worker.argv.index("worker") + 1:]
        assert flags[flags.index("--api-keys-file") + 1] == "/etc/pdserve/keys" and "--protect-metrics" in flags
