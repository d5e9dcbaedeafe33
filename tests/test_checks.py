"""Every exercise check passes the notebook's reference solution and fails planted wrong ones."""
import random
import re

import pytest
import torch

from labsupport import checks
from labsupport.engine.scheduler import SchedulerOutput

from notebook_tools import chapter, exercise_solutions, read


@pytest.fixture(scope="module")
def reference_greedy():
    return exercise_solutions(chapter("00"))["greedy_generate"]


def test_reference_greedy_generate_passes(reference_greedy, llm):
    checks.check_greedy_generate(reference_greedy, llm)


def argmax_of_first_row(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[0].argmax())
        ids.append(t); out.append(t)
        if t == eos_id:
            break
    return out


def never_stops_at_eos(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        ids.append(t); out.append(t)
    return out


def drops_the_eos_token(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        if t == eos_id:
            break
        ids.append(t); out.append(t)
    return out


def forgets_to_append(logits_of, prompt_ids, max_new_tokens, eos_id):
    out = []
    for _ in range(max_new_tokens):
        t = int(logits_of(list(prompt_ids))[-1].argmax())
        out.append(t)
        if t == eos_id:
            break
    return out


def returns_prompt_too(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        t = int(logits_of(ids)[-1].argmax())
        ids.append(t)
        if t == eos_id:
            break
    return ids


def one_token_short(logits_of, prompt_ids, max_new_tokens, eos_id):
    return never_stops_at_eos(logits_of, prompt_ids, max_new_tokens - 1, eos_id)


def samples_instead_of_argmax(logits_of, prompt_ids, max_new_tokens, eos_id):
    g = torch.Generator().manual_seed(0)
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = int(torch.multinomial(torch.softmax(logits_of(ids)[-1], -1), 1, generator=g))
        ids.append(t); out.append(t)
        if t == eos_id:
            break
    return out


def returns_tensors(logits_of, prompt_ids, max_new_tokens, eos_id):
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        t = logits_of(ids)[-1].argmax()
        ids.append(int(t)); out.append(t)
        if int(t) == eos_id:
            break
    return out


@pytest.mark.parametrize("wrong", [argmax_of_first_row, never_stops_at_eos, drops_the_eos_token, forgets_to_append,
                                   returns_prompt_too, one_token_short, samples_instead_of_argmax, returns_tensors])
def test_planted_wrong_greedy_generate_fails(wrong, llm):
    with pytest.raises(checks.CheckFailed):
        checks.check_greedy_generate(wrong, llm)


# ---------------------------------------------------------------- chapter 01

@pytest.fixture(scope="module")
def reference_cached_attention():
    return exercise_solutions(chapter("01"))["cached_attention"]


def test_reference_cached_attention_passes(reference_cached_attention):
    checks.check_cached_attention(reference_cached_attention)


def _attention(q, keys, values, start, *, scale=True, offset=True, causal=True):
    n, group = q.shape[0], q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / (q.shape[-1] ** 0.5 if scale else 1)
    qpos = (start if offset else 0) + torch.arange(n)[:, None]
    if causal:
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def no_scaling(ck, cv, start, q, k, v):
    n = q.shape[0]; ck[start:start + n] = k; cv[start:start + n] = v
    return _attention(q, ck[:start + n], cv[:start + n], start, scale=False)


def mask_without_offset(ck, cv, start, q, k, v):
    n = q.shape[0]; ck[start:start + n] = k; cv[start:start + n] = v
    return _attention(q, ck[:start + n], cv[:start + n], start, offset=False)


def writes_at_the_front(ck, cv, start, q, k, v):
    n = q.shape[0]; ck[:n] = k; cv[:n] = v
    return _attention(q, ck[:start + n], cv[:start + n], start)


def attends_before_appending(ck, cv, start, q, k, v):
    n = q.shape[0]
    out = _attention(q, ck[:start + n].clone(), cv[:start + n].clone(), start)
    ck[start:start + n] = k; cv[start:start + n] = v
    return out


def ignores_the_cache(ck, cv, start, q, k, v):
    n = q.shape[0]; ck[start:start + n] = k; cv[start:start + n] = v
    return _attention(q, k, v, 0)


def no_causal_mask(ck, cv, start, q, k, v):
    n = q.shape[0]; ck[start:start + n] = k; cv[start:start + n] = v
    return _attention(q, ck[:start + n], cv[:start + n], start, causal=False)


@pytest.mark.parametrize("wrong", [no_scaling, mask_without_offset, writes_at_the_front, attends_before_appending,
                                   ignores_the_cache, no_causal_mask])
def test_planted_wrong_cached_attention_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_cached_attention(wrong)


# ---------------------------------------------------------------- chapter 02

def test_reference_slot_mapping_and_allocator_pass():
    solutions = exercise_solutions(chapter("02"))
    slot_fn = next(v for k, v in solutions.items() if k == "slot_mapping")
    alloc_cls = next(v for k, v in solutions.items() if isinstance(v, type) and "Allocator" in k)
    checks.check_slot_mapping(slot_fn)
    checks.check_block_allocator(alloc_cls)


@pytest.mark.parametrize("wrong", [
    lambda table, start, n, bs: [table[p // bs] * bs + p % bs for p in range(start, start + n - 1)],   # one short
    lambda table, start, n, bs: [table[p // bs] * bs + p % bs for p in range(start + 1, start + n + 1)],  # off by one
    lambda table, start, n, bs: [table[p // bs] + p % bs for p in range(start, start + n)],            # block not scaled
    lambda table, start, n, bs: list(range(start, start + n)),                                         # ignores the table
    lambda table, start, n, bs: [(p // bs) * bs + p % bs for p in range(start, start + n)],            # logical blocks
])
def test_planted_wrong_slot_mapping_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_slot_mapping(wrong)


class _Base:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self):
        return len(self.free_blocks)

    def share(self, block):
        self.ref_counts[block] += 1


class NoDoubleFreeCheck(_Base):
    def allocate(self):
        if not self.free_blocks:
            raise MemoryError
        b = self.free_blocks.pop(0); self.ref_counts[b] = 1; return b

    def free(self, block):
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block] == 0 and block not in self.free_blocks:
            self.free_blocks.append(block)


class IgnoresRefCounts(_Base):
    def allocate(self):
        if not self.free_blocks:
            raise MemoryError
        b = self.free_blocks.pop(0); self.ref_counts[b] = 1; return b

    def free(self, block):
        if block in self.free_blocks:
            raise ValueError("double free")
        self.ref_counts[block] = 0
        self.free_blocks.append(block)


class Leaks(_Base):
    def allocate(self):
        if not self.free_blocks:
            raise MemoryError
        b = self.free_blocks.pop(0); self.ref_counts[b] = 1; return b

    def free(self, block):
        if self.ref_counts[block] <= 0:
            raise ValueError("double free")
        self.ref_counts[block] -= 1  # never returns the block to the free list


class HandsOutUsedBlocks(_Base):
    def allocate(self):
        b = self.free_blocks[0] if self.free_blocks else 0
        if self.free_blocks:
            self.free_blocks.pop(0)
        self.ref_counts[b] = 1
        return b

    def free(self, block):
        if self.ref_counts[block] <= 0:
            raise ValueError("double free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


@pytest.mark.parametrize("wrong", [NoDoubleFreeCheck, IgnoresRefCounts, Leaks, HandsOutUsedBlocks])
def test_planted_wrong_allocator_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_block_allocator(wrong)


def test_reference_paged_read_passes_and_runs_the_engine(llm):
    paged_read = exercise_solutions(chapter("02"))["paged_read"]
    checks.check_paged_read(paged_read)
    from labsupport import LLM
    checks.check_paged_read(paged_read, LLM(device="cpu", num_blocks=64, block_size=16))


def _slots(tables, bs):
    positions = torch.arange(tables.shape[1] * bs)
    return positions, tables.repeat_interleave(bs, dim=1) * bs + positions % bs


def _read(q, keys, values, mask, scale):
    scores = torch.einsum("bhd,hbpd->bhp", q.float(), keys.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhp,hbpd->bhd", scores.softmax(-1), values.float()).to(q.dtype)


def read_without_mask(q, k_pool, v_pool, tables, lens, bs):
    _, slots = _slots(tables, bs)
    g = q.shape[1] // k_pool.shape[0]
    return _read(q, k_pool[:, slots].repeat_interleave(g, 0), v_pool[:, slots].repeat_interleave(g, 0), None,
                 q.shape[-1] ** -0.5)


def read_heads_repeated(q, k_pool, v_pool, tables, lens, bs):            # repeat, not repeat_interleave
    positions, slots = _slots(tables, bs)
    g = q.shape[1] // k_pool.shape[0]
    return _read(q, k_pool[:, slots].repeat(g, 1, 1, 1), v_pool[:, slots].repeat(g, 1, 1, 1),
                 positions[None, None] >= lens[:, None, None], q.shape[-1] ** -0.5)


def read_logical_slots(q, k_pool, v_pool, tables, lens, bs):             # ignores the block table
    positions, _ = _slots(tables, bs)
    slots = positions[None].expand(len(lens), -1)
    g = q.shape[1] // k_pool.shape[0]
    return _read(q, k_pool[:, slots].repeat_interleave(g, 0), v_pool[:, slots].repeat_interleave(g, 0),
                 positions[None, None] >= lens[:, None, None], q.shape[-1] ** -0.5)


def read_mask_excludes_own_token(q, k_pool, v_pool, tables, lens, bs):
    positions, slots = _slots(tables, bs)
    g = q.shape[1] // k_pool.shape[0]
    return _read(q, k_pool[:, slots].repeat_interleave(g, 0), v_pool[:, slots].repeat_interleave(g, 0),
                 positions[None, None] >= (lens - 1).clamp(min=1)[:, None, None], q.shape[-1] ** -0.5)


def read_that_writes(q, k_pool, v_pool, tables, lens, bs):              # zeroes the pool's padding "to be safe"
    positions, slots = _slots(tables, bs)
    for i, n in enumerate(lens.tolist()):
        k_pool[:, slots[i, n:]] = 0
    return exercise_solutions(chapter("02"))["paged_read"](q, k_pool, v_pool, tables, lens, bs)


@pytest.mark.parametrize("wrong", [read_without_mask, read_heads_repeated, read_logical_slots,
                                   read_mask_excludes_own_token, read_that_writes,
                                   lambda q, k, v, t, n, bs: q.clone(),                       # returns the query
                                   lambda q, k, v, t, n, bs: q[:, :1]])                       # wrong shape
def test_planted_wrong_paged_read_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_paged_read(wrong)


# ---------------------------------------------------------------- chapter 03

from labsupport.engine.prefix_cache import hash_block  # noqa: E402


def test_reference_prefix_cache_solutions_pass():
    solutions = exercise_solutions(chapter("03"))
    checks.check_chain_hashes(solutions["chain_hashes"])
    checks.check_longest_prefix(solutions["longest_prefix"])


def ignores_parent(tokens, bs, salt=None):
    return [hash_block(None, tokens[i * bs:(i + 1) * bs], salt) for i in range(len(tokens) // bs)]


def ignores_salt(tokens, bs, salt=None):
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs]); out.append(parent)
    return out


def hashes_partial_block(tokens, bs, salt=None):
    out, parent = [], None
    for i in range(-(-len(tokens) // bs)):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], salt); out.append(parent)
    return out


@pytest.mark.parametrize("wrong", [ignores_parent, ignores_salt, hashes_partial_block])
def test_planted_wrong_chain_hashes_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_chain_hashes(wrong)


def skips_misses(hashes, lookup):
    return [b for i, h in enumerate(hashes) if (b := lookup(i, h)) is not None]


def stops_one_early(hashes, lookup):
    found = []
    for i, h in enumerate(hashes[:-1]):
        if (b := lookup(i, h)) is None:
            break
        found.append(b)
    return found


@pytest.mark.parametrize("wrong", [skips_misses, stops_one_early])
def test_planted_wrong_longest_prefix_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_longest_prefix(wrong)


# ---- chapter 03's hard exercise: admitting a prefix hit; the planted bug --------------------------

@pytest.fixture(scope="module")
def admission_solutions():
    solutions = exercise_solutions(chapter("03"))
    return {k: solutions[k] for k in ("free_blocks_needed", "hold_prefix_blocks", "release_blocks",
                                      "find_leaked_blocks", "BUGGY_FUNCTION", "fixed_piece")}


@pytest.fixture(scope="module")
def prefix_llm():
    from labsupport import LLM

    return LLM(device="cpu", num_blocks=64, block_size=16, enable_prefix_caching=True)


def test_reference_prefix_admission_passes_and_runs_the_engine(admission_solutions, prefix_llm):
    s = admission_solutions
    checks.check_prefix_admission(s["free_blocks_needed"], s["hold_prefix_blocks"], s["release_blocks"], llm=prefix_llm)
    checks.check_leak_finder(s["find_leaked_blocks"], llm=prefix_llm)
    assert prefix_llm.stats()["kv_blocks_free"] == 64  # the leaking pool went with the check


def cost_ignores_sharing(ref_counts, hit_blocks, num_blocks):
    return num_blocks


def cost_counts_cached_as_held(ref_counts, hit_blocks, num_blocks):
    return num_blocks - len(hit_blocks)


def hold_always_shares(allocator, hit_blocks):
    for block in hit_blocks:
        allocator.share(block)


def hold_allocates_fresh(allocator, hit_blocks):
    for block in hit_blocks:
        if allocator.ref_counts[block] > 0:
            allocator.share(block)
        else:
            allocator.allocate()


def release_head_first(allocator, block_table):
    for block in block_table:
        allocator.free(block)


def release_ignores_sharing(allocator, block_table):
    for block in reversed(block_table):
        allocator.ref_counts[block] = 0
        allocator.free_blocks[block] = None


def release_by_descending_id(allocator, block_table):   # tail first only where blocks were handed out in order
    for block in sorted(block_table, reverse=True):
        allocator.free(block)


@pytest.mark.parametrize("piece,wrong", [("free_blocks_needed", cost_ignores_sharing),
                                         ("free_blocks_needed", cost_counts_cached_as_held),
                                         ("hold_prefix_blocks", hold_always_shares),
                                         ("hold_prefix_blocks", hold_allocates_fresh),
                                         ("release_blocks", release_head_first),
                                         ("release_blocks", release_ignores_sharing),
                                         ("release_blocks", release_by_descending_id)])
def test_planted_wrong_prefix_admission_fails(admission_solutions, piece, wrong):
    pieces = {k: admission_solutions[k] for k in ("free_blocks_needed", "hold_prefix_blocks", "release_blocks")}
    pieces[piece] = wrong
    with pytest.raises(checks.CheckFailed):
        checks.check_prefix_admission(**pieces)


def test_head_first_release_loses_the_prefix_in_the_engine(prefix_llm):
    """What the unit check's order test stands for: under eviction the engine really hits less."""
    own = checks.admission_scenario(prefix_llm)
    head = checks.admission_scenario(prefix_llm, release_blocks=release_head_first)
    assert own[0] == head[0] and own[2] == head[2] == (0, False)
    assert own[1][:3] == head[1][:3] and own[1][3] > head[1][3]


def leak_finder_orphans_only(snapshot):
    return [b for b, (r, o) in enumerate(zip(snapshot["ref_counts"], snapshot["owners"])) if r > 0 and not o]


def leak_finder_all_held(snapshot):
    return [b for b, r in enumerate(snapshot["ref_counts"]) if r > 0]


@pytest.mark.parametrize("wrong", [leak_finder_orphans_only, leak_finder_all_held])
def test_planted_wrong_leak_finder_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_leak_finder(wrong)


# ---- chapter 03's planted-bug hunt: five bugs in chapter 03's block keeping, drawn at random ------------

from labsupport.checks import mystery  # noqa: E402
from labsupport.engine import block_pool  # noqa: E402

SEEDS = range(8)  # the seeds an attendee is likely to try: the notebook's default and the next few


def _seed_drawing(kind):
    return next(seed for seed in range(100) if random.Random(seed).choice(mystery.BUG_KINDS) == kind)


def _notebook_seed():
    params = next(c for c in read(chapter("03")).cells if "parameters" in c.metadata.get("tags", []))
    return int(re.search(r"^MYSTERY_SEED = (\d+)", params.source, re.MULTILINE).group(1))


def _summary(phases):
    return [(p.tokens, p.hits, p.free_after, p.error) for p in phases]


@pytest.fixture(scope="module")
def bug_runs(prefix_llm):
    """kind -> the planted-bug engine's phases (one run a kind: the pieces depend on the kind alone)."""
    return {kind: mystery.workload(prefix_llm, **mystery.planted_pieces(kind)) for kind in mystery.BUG_KINDS}


def test_reference_diagnosis_fixes_the_notebooks_planted_bug(admission_solutions, prefix_llm):
    s = admission_solutions
    checks.check_bug_fix(checks.planted_bug(prefix_llm, seed=_notebook_seed()), s["BUGGY_FUNCTION"], s["fixed_piece"])
    assert prefix_llm.stats()["kv_blocks_free"] == 64
    kv = prefix_llm.engine.kv  # the engine's own pieces are back
    assert (kv.free_blocks_needed, kv.hold_prefix_blocks, kv.release_blocks) == \
        (block_pool.free_blocks_needed, block_pool.hold_prefix_blocks, block_pool.release_blocks)


def test_the_draw_is_seeded_and_the_first_seeds_reach_every_bug(prefix_llm):
    reveal = mystery.reveal
    assert reveal(checks.planted_bug(prefix_llm, seed=5)) == reveal(checks.planted_bug(prefix_llm, seed=5))
    assert {reveal(checks.planted_bug(prefix_llm, seed=s))[0] for s in SEEDS} == set(mystery.BUG_KINDS)


def test_every_bug_sits_in_block_keeping_chapter_03_taught(prefix_llm):
    """Chapter 03 plants bugs only in what was taught before the hunt: no copy-on-write (section 11, after it), no
    plug point whose fix is another chapter's exercise answer."""
    taught = {"free_blocks_needed", "hold_prefix_blocks", "release_blocks"}
    assert set(mystery.FUNCTIONS) == taught
    assert {mystery.reveal(checks.planted_bug(prefix_llm, seed=s))[1] for s in range(40)} == taught
    cells = read(chapter("03")).cells
    hunt = next(i for i, c in enumerate(cells) if c.cell_type == "code" and "checks.planted_bug(" in c.source)
    before_the_hunt = "\n".join(c.source for c in cells[:hunt] if c.cell_type == "code")
    assert "copy_on_write" not in before_the_hunt


@pytest.mark.parametrize("seed", SEEDS)
def test_every_seeds_bug_shows_in_the_evidence(prefix_llm, bug_runs, seed):
    """Whatever was drawn differs from the engine's own run in at least one column of the evidence table."""
    bug = checks.planted_bug(prefix_llm, seed=seed)
    kind, name, _ = mystery.reveal(bug)
    assert bug.pieces == mystery.planted_pieces(kind)
    own, phases = bug.own(), bug_runs[kind]
    assert _summary(phases) != _summary(own)
    assert mystery.first_difference(phases, own) is not None
    assert "#" not in bug.source(name) and f"def {name}(" in bug.source(name)  # no comment gives it away


def test_each_bug_leaves_its_own_mark(prefix_llm, bug_runs):
    """The five bugs are told apart by the evidence: where the first difference is, and in which column."""
    own = mystery.own_run(prefix_llm)
    marks = {kind: mystery.first_difference(phases, own) for kind, phases in bug_runs.items()}
    assert len(set(marks.values())) == len(marks), marks
    assert "blocks were free" in marks["leak"] and "reused" in marks["head_first"]
    assert "'two at once' failed" in marks["lost_share"] and "'one after' failed" in marks["fresh_block"]
    assert "'tight pool' failed" in marks["over_admission"] and "MemoryError" in marks["over_admission"]


def test_the_reference_fix_passes_for_every_seed(prefix_llm):
    """``bug.reference()``, what USE_REFERENCE swaps in, fixes whatever the seed drew. Seeds drawing the same bug
    plant the same pieces and get the same reference, so each distinct (pieces, fix) is checked once."""
    cases = {}
    for seed in SEEDS:
        bug = checks.planted_bug(prefix_llm, seed=seed)
        name, fix = bug.reference()
        assert name == mystery.reveal(bug)[1] and fix is getattr(block_pool, name)
        cases.setdefault((tuple(bug.pieces.items()), name, fix), bug)
    assert len(cases) == len(mystery.BUG_KINDS)
    for (_, name, fix), bug in cases.items():
        checks.check_bug_fix(bug, name, fix)
        assert mystery.reveal(bug)[2] in bug.reveal() and f"def {name}(" in bug.reveal()
    assert prefix_llm.stats()["kv_blocks_free"] == 64 and not prefix_llm.engine.kv.tables


@pytest.mark.parametrize("kind", mystery.BUG_KINDS)
def test_a_wrong_name_with_a_plausible_fix_fails_like_no_fix(prefix_llm, bug_runs, kind):
    """A correct function installed at the wrong plug point leaves the bug in place: the check says where it still
    shows, in the words of the evidence, and nothing that names (or rules out) the function that carries it."""
    bug = checks.planted_bug(prefix_llm, seed=_seed_drawing(kind))
    right = mystery.reveal(bug)[1]
    wrong = next(f for f in mystery.FUNCTIONS if f != right)
    with pytest.raises(checks.CheckFailed) as failed:
        checks.check_bug_fix(bug, wrong, getattr(block_pool, wrong))
    message = str(failed.value)
    assert mystery.first_difference(bug_runs[kind], bug.own()) in message
    assert right not in message and "not where" not in message


def test_the_stub_gets_a_message_saying_what_to_set(prefix_llm):
    bug = checks.planted_bug(prefix_llm, seed=0)
    with pytest.raises(checks.CheckFailed, match="set BUGGY_FUNCTION to"):
        checks.check_bug_fix(bug, None, None)
    with pytest.raises(checks.CheckFailed, match="name one of"):
        checks.check_bug_fix(bug, "copy_on_write", block_pool.copy_on_write)
    with pytest.raises(checks.CheckFailed, match="must be a function"):
        checks.check_bug_fix(bug, "release_blocks", "tail first")


def test_a_listing_of_the_module_or_the_bug_does_not_name_the_drawn_function(prefix_llm):
    """The hunt is read from the evidence: neither the module's source nor the planted-bug object's attributes
    pair a kind of bug with its function or its copy."""
    import inspect
    source = inspect.getsource(mystery)
    for kind in mystery.BUG_KINDS:
        function = mystery.reveal(checks.planted_bug(prefix_llm, seed=_seed_drawing(kind)))[1]
        assert not re.search(rf"{kind}.{{0,40}}{function}", source, re.DOTALL), kind
        bug = checks.planted_bug(prefix_llm, seed=_seed_drawing(kind))
        assert not [v for v in vars(bug).values() if isinstance(v, str) and v in mystery.FUNCTIONS]


def test_the_correct_copies_behave_like_the_engines_own(prefix_llm):
    own, copies = mystery.own_run(prefix_llm), mystery.workload(prefix_llm, **mystery.correct_pieces())
    assert _summary(copies) == _summary(own)
    assert all(p.free_after == mystery.POOL_BLOCKS and p.error is None for p in own)
    assert [p.hits for p in own][-1] > 0  # the tight pool's prefix waited for the long request, and was still cached


# ---- chapter 04: schedule() ---------------------------------------------------------------------

def test_reference_schedule_passes(llm):
    checks.check_schedule(exercise_solutions(chapter("04"))["schedule"], llm)


def _running_first(s, batch, budget, victim=lambda s: s.running[-1]):
    for req in list(s.running):
        if req not in s.running:
            continue
        need = s.num_new_tokens(req, budget, batch)
        if need == 0:
            break
        while not s.kv.can_allocate(req, need):
            s.preempt(victim(s))
            if req not in s.running:
                break
        if req in s.running:
            s.add_to_batch(batch, req, need)
            budget -= need
    return budget


def _admit_fcfs(s, batch, budget, max_seqs=None):
    while s.waiting and len(s.running) < (max_seqs or s.config.max_num_seqs):
        req = s.waiting[0]
        need = s.num_new_tokens(req, budget, batch)
        if need == 0 or not s.kv.can_allocate(req, need):
            break
        s.admit(req)
        s.add_to_batch(batch, req, need)
        budget -= need
    return budget


def ignores_the_token_budget(s):
    batch = SchedulerOutput()
    _running_first(s, batch, 10**9)
    _admit_fcfs(s, batch, 10**9)
    return batch


def lets_short_prompts_overtake(s):
    batch = SchedulerOutput()
    budget = _running_first(s, batch, s.config.max_num_batched_tokens)
    for req in list(s.waiting):
        need = s.num_new_tokens(req, budget, batch)
        if len(s.running) < s.config.max_num_seqs and need and s.kv.can_allocate(req, need):
            s.admit(req)
            s.add_to_batch(batch, req, need)
            budget -= need
    return batch


def skips_instead_of_preempting(s):
    batch = SchedulerOutput()
    budget = s.config.max_num_batched_tokens
    for req in list(s.running):
        need = s.num_new_tokens(req, budget, batch)
        if need and s.kv.can_allocate(req, need):
            s.add_to_batch(batch, req, need)
            budget -= need
    _admit_fcfs(s, batch, budget)
    return batch


def static_batches(s):
    batch = SchedulerOutput()
    idle = not s.running
    budget = _running_first(s, batch, s.config.max_num_batched_tokens)
    if idle:
        _admit_fcfs(s, batch, budget)
    return batch


def admits_before_running(s):
    batch = SchedulerOutput()
    old = list(s.running)
    budget = _admit_fcfs(s, batch, s.config.max_num_batched_tokens)
    for req in old:
        need = s.num_new_tokens(req, budget, batch)
        if need and s.kv.can_allocate(req, need):
            s.add_to_batch(batch, req, need)
            budget -= need
    return batch


def preempts_the_oldest(s):
    batch = SchedulerOutput()
    _admit_fcfs(s, batch, _running_first(s, batch, s.config.max_num_batched_tokens, victim=lambda s: s.running[0]))
    return batch


def ignores_max_num_seqs(s):
    batch = SchedulerOutput()
    _admit_fcfs(s, batch, _running_first(s, batch, s.config.max_num_batched_tokens), max_seqs=10**9)
    return batch


def feeds_one_token_at_a_time(s):
    batch = SchedulerOutput()
    for req in list(s.running) + list(s.waiting)[:s.config.max_num_seqs - len(s.running)]:
        if req in s.waiting and s.kv.can_allocate(req, 1):
            s.admit(req)
        if req in s.running and s.kv.can_allocate(req, 1):
            s.add_to_batch(batch, req, 1)
    return batch


@pytest.mark.parametrize("wrong", [ignores_the_token_budget, lets_short_prompts_overtake, skips_instead_of_preempting,
                                   static_batches, admits_before_running, preempts_the_oldest, ignores_max_num_seqs,
                                   feeds_one_token_at_a_time])
def test_planted_wrong_schedule_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_schedule(wrong)


# ---- chapter 05: the chunking rule --------------------------------------------------------------

def test_reference_chunk_rule_passes(llm):
    checks.check_chunk_rule(exercise_solutions(chapter("05"))["chunk_rule"], llm)


@pytest.mark.parametrize("wrong", [
    lambda r, b, c, t=0: r,                                                    # ignores the budget
    lambda r, b, c, t=0: min(r, b),                                            # chunks even when disabled
    lambda r, b, c, t=0: r if r <= b else (b if c else 0),                     # ignores the threshold
    lambda r, b, c, t=0: min(t, b) if c and t else (r if r <= b else (b if c else 0)),  # pads to the threshold
    lambda r, b, c, t=0: min(r, t or r) if c else (r if r <= b else 0),        # lets the threshold beat the budget
    lambda r, b, c, t=0: r if r <= b else (b - 1 if c else 0),                 # off by one
])
def test_planted_wrong_chunk_rule_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_chunk_rule(wrong)


# ---- chapter 05's hard exercise: admitting the head of the queue ---------------------------------

def test_reference_admission_passes(llm):
    checks.check_admission(exercise_solutions(chapter("05"))["admit_one"], llm)


def _admission(skip_hit=True, admit_with_hit=True, kv_for="chunk", chunk="rule", alone=True, kv_hit=True):
    """An admission with one rule changed (the defaults are the right one)."""
    def admit(s, req, out, budget_left):
        hit = s.kv.find_cached_prefix(req)
        remaining = req.num_tokens - req.num_computed_tokens - (hit.num_tokens if skip_hit else 0)
        if chunk == "rule":
            n = s.chunk_rule(remaining, budget_left, s.config.enable_chunked_prefill,
                             s.config.long_prefill_token_threshold)
        elif chunk == "whole":
            n = remaining if remaining <= budget_left else 0
        else:  # "no threshold"
            n = min(remaining, budget_left) if s.config.enable_chunked_prefill else (
                remaining if remaining <= budget_left else 0)
        if n == 0 and not out.requests and alone:
            n = remaining
        need = n if kv_for == "chunk" else remaining
        if n == 0 or not s.kv.can_allocate(req, need, hit if kv_hit else None):
            return 0
        s.admit(req, hit if admit_with_hit else None)
        s.add_to_batch(out, req, n)
        return n
    return admit


@pytest.mark.parametrize("wrong", [
    _admission(skip_hit=False, admit_with_hit=False),  # ignores the prefix cache
    _admission(admit_with_hit=False),                  # skips the hit's tokens but does not admit with it
    _admission(kv_for="prompt"),                       # asks the pool for the whole prompt
    _admission(chunk="whole"),                         # no first chunk: whole prompts only
    _admission(chunk="no threshold"),                  # ignores long_prefill_token_threshold
    _admission(alone=False),                           # an over-budget prompt never runs
    _admission(kv_hit=False),                          # leaves the hit out of the memory check
])
def test_planted_wrong_admission_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_admission(wrong)


# ---- chapter 03's exercise on sharing: fork and copy-on-write for n > 1 ------------------------------

@pytest.fixture(scope="module")
def cow_solutions():
    solutions = exercise_solutions(chapter("03"))
    return solutions["fork_blocks"], solutions["copy_on_write"]


def test_reference_copy_on_write_passes_and_runs_the_engine(cow_solutions):
    from labsupport import LLM

    checks.check_copy_on_write(*cow_solutions, LLM(device="cpu", num_blocks=64, max_num_seqs=4), n=3)


def fork_without_sharing(allocator, block_table):
    return list(block_table)


def fork_sharing_one_list(allocator, block_table):
    for block in block_table:
        allocator.share(block)
    return block_table


def cow_never_copies(allocator, block_table, index, new_block, copy_block):
    pass


def cow_keeps_the_original(allocator, block_table, index, new_block, copy_block):
    if allocator.ref_counts[block_table[index]] > 1:
        copy = new_block()
        copy_block(block_table[index], copy)
        block_table[index] = copy


def cow_always_copies(allocator, block_table, index, new_block, copy_block):
    copy = new_block()
    copy_block(block_table[index], copy)
    allocator.free(block_table[index])
    block_table[index] = copy


def cow_copies_backwards(allocator, block_table, index, new_block, copy_block):
    if allocator.ref_counts[block_table[index]] > 1:
        copy = new_block()
        copy_block(copy, block_table[index])
        allocator.free(block_table[index])
        block_table[index] = copy


@pytest.mark.parametrize("fork,cow", [(fork_without_sharing, None), (fork_sharing_one_list, None),
                                      (None, cow_never_copies), (None, cow_keeps_the_original),
                                      (None, cow_always_copies), (None, cow_copies_backwards)])
def test_planted_wrong_copy_on_write_fails(cow_solutions, fork, cow):
    with pytest.raises(checks.CheckFailed):
        checks.check_copy_on_write(fork or cow_solutions[0], cow or cow_solutions[1])


def test_a_copy_on_write_that_never_copies_corrupts_the_engine_samples():
    """The unit check's 'never copies' case stands for this: the samples overwrite each other's KV."""
    from labsupport import LLM, SamplingParams

    llm = LLM(device="cpu", num_blocks=64, max_num_seqs=4)
    chat = [{"role": "user", "content": "Name a colour and say why you like it."}]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    good = [o.token_ids for o in llm.generate(chat, params, use_tqdm=False)[0].outputs]
    with llm.plugged(copy_on_write=cow_never_copies):
        bad = [o.token_ids for o in llm.generate(chat, params, use_tqdm=False)[0].outputs]
    assert bad != good and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


# ---- chapter 09's exercise: the acceptance rule of speculative decoding --------------------------

def _rule(accept="ratio", residual="residual", bonus=True, use_q=True, recovered="draw"):
    """Planted acceptance rules, each one mistake away from spec_decode.rejection_sample."""
    def rule(target_probs, guesses, draft_probs, generator=None):
        out = []
        for j, d in enumerate(guesses):
            p = target_probs[j]
            q = draft_probs[j] if draft_probs is not None and use_q else torch.nn.functional.one_hot(
                torch.tensor(d), p.shape[-1]).float()
            u = float(torch.rand((), generator=generator))
            ok = {"ratio": u < float(p[d]) / max(float(q[d]), 1e-12), "always": True,
                  "p>q": float(p[d]) >= float(q[d]), "inverted": u < float(q[d]) / max(float(p[d]), 1e-12)}[accept]
            if ok:
                out.append(d)
                continue
            if recovered == "guess":
                out.append(d)
                return out
            if recovered == "argmax":  # no draw at all: right for one-hot targets only
                out.append(int(p.argmax()))
                return out
            r = (p - q).clamp(min=0) if residual == "residual" else p
            r = r if float(r.sum()) > 0 else p
            out.append(int(torch.multinomial(r / r.sum(), 1, generator=generator)))
            return out
        if bonus:
            out.append(int(torch.multinomial(target_probs[len(guesses)], 1, generator=generator)))
        return out
    return rule


@pytest.fixture(scope="module")
def ngram_llm():
    from labsupport import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(device="cpu", num_blocks=64, speculative_config=spec)
    yield llm
    llm.shutdown()


def test_reference_acceptance_rule_passes_and_runs_in_the_engine(ngram_llm, capsys):
    from labsupport.engine.spec_decode import rejection_sample

    checks.check_acceptance_rule(rejection_sample, ngram_llm, trials=4000)  # greedy and sampled in the engine
    assert "in the engine, sampled at temperature 1" in capsys.readouterr().out
    checks.check_acceptance_rule(_rule(), trials=4000)  # the planted family's own right member


@pytest.mark.parametrize("wrong", [
    _rule(accept="p>q"),           # accept when p(d) >= q(d), no random draw: a certain guess is never kept
    _rule(recovered="argmax"),     # on a rejection, the target's argmax instead of a draw from the residual
])
def test_sampled_check_in_the_engine_fails_a_rule_that_passes_greedy(ngram_llm, wrong):
    """These rules are right whenever p is one-hot, so the engine's greedy check passes them; sampled at
    temperature 1 in the same engine, the first verified token's counts leave the target's tolerance."""
    from labsupport.checks.acceptance import check_greedy_in_engine, check_sampled_in_engine

    check_greedy_in_engine(wrong, ngram_llm)
    with pytest.raises(checks.CheckFailed, match="standard deviations"):
        check_sampled_in_engine(wrong, ngram_llm)
    stats = ngram_llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("wrong", [
    _rule(accept="always"),        # every guess accepted: fast and wrong
    _rule(accept="p>q"),           # deterministic acceptance: greedy right, sampling skewed
    _rule(accept="inverted"),      # q / p instead of p / q
    _rule(residual="p"),           # resamples from p: the rejected token comes back too often
    _rule(bonus=False),            # no bonus token after all guesses survive
    _rule(use_q=False),            # ignores the draft's distribution
    _rule(recovered="guess"),      # emits the rejected guess
])
def test_planted_wrong_acceptance_rule_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_acceptance_rule(wrong, trials=4000)


# ---- chapter 02's hard exercise, part 2: one read for a mixed step of prefills and decodes ----------

def _mixed_reference():
    return exercise_solutions(chapter("02"))["paged_read_mixed"]


def _rows_of(query_lens, context_lens):
    """Each row's sequence and position, as the reference computes them."""
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    first_row = torch.cumsum(query_lens, 0) - query_lens
    return seq, (context_lens - query_lens)[seq] + torch.arange(len(seq)) - first_row[seq]


def mixed_without_causal_mask(q, k_pool, v_pool, tables, qlens, clens, bs):   # every row sees the whole context
    seq, _ = _rows_of(qlens, clens)
    return exercise_solutions(chapter("02"))["paged_read"](q, k_pool, v_pool, tables[seq], clens[seq], bs)


def mixed_row_reads_its_block_only(q, k_pool, v_pool, tables, qlens, clens, bs):   # ignores the earlier blocks
    seq, pos = _rows_of(qlens, clens)
    own_block = tables[seq, pos // bs][:, None]
    return exercise_solutions(chapter("02"))["paged_read"](q, k_pool, v_pool, own_block, pos % bs + 1, bs)


def mixed_positions_off_by_one(q, k_pool, v_pool, tables, qlens, clens, bs):   # length = position: own key left out
    seq, pos = _rows_of(qlens, clens)
    return exercise_solutions(chapter("02"))["paged_read"](q, k_pool, v_pool, tables[seq], pos.clamp(min=1), bs)


def mixed_rows_not_reset_per_sequence(q, k_pool, v_pool, tables, qlens, clens, bs):   # offset from the step's row 0
    seq = torch.repeat_interleave(torch.arange(len(qlens)), qlens)
    pos = (clens - qlens)[seq] + torch.arange(len(seq))
    return exercise_solutions(chapter("02"))["paged_read"](q, k_pool, v_pool, tables[seq], pos + 1, bs)


MIXED_WRONG = [mixed_without_causal_mask, mixed_row_reads_its_block_only, mixed_positions_off_by_one,
               mixed_rows_not_reset_per_sequence]


def test_reference_paged_read_mixed_passes_and_runs_the_engine():
    from labsupport import LLM

    llm = LLM(device="cpu", num_blocks=64, block_size=16)
    checks.check_paged_read_mixed(_mixed_reference(), llm)
    assert llm.engine.backend.mixed_attention is None  # the engine's own split paths are back


@pytest.mark.parametrize("wrong", MIXED_WRONG + [lambda q, k, v, t, n, c, bs: q.clone(),   # returns the query
                                                 lambda q, k, v, t, n, c, bs: q[:1]])      # wrong shape
def test_planted_wrong_paged_read_mixed_fails(wrong):
    with pytest.raises(checks.CheckFailed):
        checks.check_paged_read_mixed(wrong)


def test_mixed_read_plugged_into_the_engine_really_runs_every_step():
    """A read without the causal mask, plugged in, changes the engine's tokens: the plug point is live."""
    from labsupport import LLM
    from labsupport.checks.paged_read import _run_engine_mixed

    with pytest.raises(checks.CheckFailed, match="other tokens"):
        _run_engine_mixed(mixed_without_causal_mask, LLM(device="cpu", num_blocks=64, block_size=16))
