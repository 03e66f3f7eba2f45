"""`moray bench serve`'s tiered multi-turn workload (issue #15) and its unlimited-cache oracle."""

from __future__ import annotations

import random

from bench.serve import oracle_hit_tokens, tiered_workload


def test_tiered_workload_shape():
    rng = random.Random(0)
    tok = lambda k: [rng.randrange(3, 500) for _ in range(k)]  # noqa: E731
    groups = tiered_workload(random.Random(1), tok, conversations=64)
    assert len(groups) == 64 and all(len(g) == 6 for g in groups)
    for g in groups:
        lengths = [len(i.prompt) for i in g]
        assert lengths == [256 + 64 + 96 * t for t in range(6)]  # growing histories: 320 .. 800 tokens
        assert all(a.prompt == b.prompt[: len(a.prompt)] for a, b in zip(g, g[1:]))  # each turn extends the last
        assert g[0].think_s == 0 and all(i.think_s > 0 for i in g[1:])
        assert len({i.session for i in g}) == 1 and [i.turn for i in g] == list(range(6))
    assert len({g[0].session for g in groups}) == 64


def test_oracle_reuses_every_full_block_of_the_previous_turn_and_nothing_across_conversations():
    rng = random.Random(2)
    tok = lambda k: [rng.randrange(3, 500) for _ in range(k)]  # noqa: E731
    groups = tiered_workload(random.Random(3), tok, conversations=3, think_s=0)
    hits = oracle_hit_tokens(groups, 16)
    for c, g in enumerate(groups):
        expected = [0] + [len(prev.prompt) // 16 * 16 for prev in g[:-1]]
        assert hits[c * 6 : (c + 1) * 6] == expected
