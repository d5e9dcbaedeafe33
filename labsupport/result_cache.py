"""Result cache: the whole response for a request seen before, without touching the model.

The cheapest token is the one never computed, but reusing a *result* is only right when the
same request must give the same answer: greedy decoding (temperature 0) or a fixed seed. A
sampled request without a seed asks for a fresh draw, so it is never cached. The key holds
everything that can change the answer (model, the prompt's token ids -- messages normalized by
the chat template into exactly what the model sees -- and the sampling parameters) and the
tenant's ``cache_salt``, so one tenant never receives another's cached answer. Entries expire
(``ttl_s``: a model or a system prompt may change behind the same name) and the cache is bounded
(``max_entries``, least recently used out first). It is locked: the server tokenizes, and so looks
requests up, on worker threads while its event loop stores finished answers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict


def is_deterministic(params) -> bool:
    """May this request be answered from (and stored in) the result cache? A PD hand-off never is:
    its answer is a side effect on another engine (KV held for a pull), not only text. Nor is a
    request for n > 1 samples: its answer is several outputs, not one."""
    if getattr(params, "kv_transfer_params", None) or getattr(params, "n", 1) > 1:
        return False
    return params.temperature == 0 or params.seed is not None


def result_key(model: str, prompt_token_ids: list[int], params, cache_salt: str | None) -> str:
    payload = {"model": model, "prompt": list(prompt_token_ids), "salt": cache_salt,
               "params": dataclasses.asdict(params)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class ResultCache:
    def __init__(self, max_entries: int = 1024, ttl_s: float = 600.0):
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self.entries: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            entry = self.entries.get(key)
            if entry is None or time.monotonic() - entry[0] > self.ttl_s:
                self.entries.pop(key, None)
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return entry[1]

    def put(self, key: str, value):
        with self._lock:
            self.entries[key] = (time.monotonic(), value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)

    def __len__(self):
        return len(self.entries)
