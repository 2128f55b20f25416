"""A prompt-cache isolation audit after Gu et al. ("Auditing Prompt Caching in Language Model
APIs", ICML 2025): can one tenant tell, from outside, that another tenant sent a prompt?

For each audit prompt the victim sends it once (so it is cached for the victim), then:
- `cross`: the attacker sends the same prompt — what an attacker probing the cache sees;
- `hit`: the victim sends it again — the positive control, a real cache hit;
- `miss`: the attacker sends a prompt nobody sent — the baseline of an uncached prompt.
Each request streams; its TTFT is the time to the first token and its cached tokens come from
the final usage. Two-sample Kolmogorov–Smirnov tests then compare `hit` with `miss` (must
differ: else the audit cannot see a cache at all) and `cross` with `miss` (must not: else the
cache leaks across tenants). Timing is the signal an attacker has; cached-token counts stand
in where timing is too noisy (CI), with the same positive control.
"""
import json
import time
from dataclasses import asdict, dataclass

import httpx

from pdserve.bench.ks import ks_2samp

KINDS = ("miss", "hit", "cross")


@dataclass(frozen=True, slots=True)
class Sample:
    kind: str  # miss | hit | cross
    ttft_s: float
    cached_tokens: int
    route: str  # the router's X-Pdserve-Route: where it went and the prefix overlap it saw


@dataclass(frozen=True, slots=True)
class Verdict:
    """KS statistics and p-values of `hit` and `cross` against `miss`, for one measure."""

    measure: str
    hit_statistic: float
    hit_p: float
    cross_statistic: float
    cross_p: float

    def is_isolated(self, alpha: float = 0.05) -> bool:
        """The cache is visible to its own tenant (hit differs from miss at `alpha`) and not
        across tenants (cross does not)."""
        return self.hit_p < alpha <= self.cross_p


def measure_one(client: httpx.Client, key: str, prompt: str, kind: str, max_tokens: int = 2) -> Sample:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, cached = None, None
    with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"audit request refused: {response.status_code} {response.read()[:300]!r}")
        route = response.headers.get("x-pdserve-route", "")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if ttft is None or cached is None:
        raise RuntimeError("audit stream ended without a token or without usage")
    return Sample(kind, ttft, cached, route)


def run_audit(client: httpx.Client, victim_key: str, attacker_key: str, prompts: list[str],
              fresh_prompts: list[str]) -> list[Sample]:
    """Samples of every kind, one of each per prompt, interleaved so drift hits all kinds alike."""
    if len(fresh_prompts) != len(prompts):
        raise ValueError("one fresh prompt per audit prompt")
    samples = []
    for prompt, fresh in zip(prompts, fresh_prompts, strict=True):
        measure_one(client, victim_key, prompt, "victim")  # now cached for the victim
        samples.append(measure_one(client, attacker_key, prompt, "cross"))
        samples.append(measure_one(client, victim_key, prompt, "hit"))
        samples.append(measure_one(client, attacker_key, fresh, "miss"))
    return samples


def verdict(samples: list[Sample], measure: str) -> Verdict:
    """`measure`: "ttft_s" or "cached_tokens"."""
    values = {kind: [float(getattr(s, measure)) for s in samples if s.kind == kind] for kind in KINDS}
    hit = ks_2samp(values["hit"], values["miss"])
    cross = ks_2samp(values["cross"], values["miss"])
    return Verdict(measure, *hit, *cross)


def report(samples: list[Sample]) -> dict:
    return {"samples": [asdict(s) for s in samples],
            "verdicts": {m: {**asdict(v), "isolated": v.is_isolated()}
                         for m in ("ttft_s", "cached_tokens") for v in [verdict(samples, m)]}}
