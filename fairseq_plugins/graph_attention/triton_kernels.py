"""Triton kernels of the ``triton`` graph-attention backend: flash attention over a tile plan.

The plan (``tile_plan``) cuts the graph's query rows, in tree order, into blocks of
``BLOCK_M`` slots and gives each block a few key tiles: ``BLOCK_N`` consecutive key nodes
starting anywhere, with an int16 tile of edge types (-1 = no edge). The key-major side of the
backward has the transposed tiles: aligned blocks of ``BLOCK_N`` keys (its constexprs are
swapped, so that both sides' products have the plan's block_m rows), each with windows of
``BLOCK_M`` consecutive query slots. A work item is one block and a range of its tiles; an
item whose block is split across programs writes a partial result in fp32, which a merge
kernel (below) combines with the block's other parts.

Every tile kernel runs one (work item, batch x head) per program, every merge kernel one
(split block, batch x head). Scores and softmax statistics
are fp32, in base 2 (log2(e) is folded into the scale and into the caller's relative-key
table, so the exponentials are ``exp2``; the log-sum-exps written are natural); every product
has the input precision ``PRECISION`` (tf32x3 for fp32 operands). Relative keys
(``HAS_REL``), a padding mask (``HAS_PAD``) and dropout (``DROPOUT``) are constexprs: a
binary without them runs none of their instructions.

Under the interpreter (``UPCAST``, bf16) the operands are loaded as fp32 (its bf16 ``tl.dot``
is wrong, Triton issue 11584, and its fp32 -> bf16 cast truncates): every value a GPU rounds
to bf16 (P and dS before their products, the stored rows) is rounded to nearest even in fp32
by ``_rounded``, so that the CPU tests see the GPU's rounding.

Dropout keeps an edge when a hash of (seed, batch x head, query node, key node) passes a
threshold, so the backward regenerates the same mask in any order;
the seed is a device tensor (``seed_ptr``), drawn on the device by the caller.

Every [B, H, N, D] tensor (q, k, v, the output, dO and the gradients) is read or written
through its own element strides of the batch, head and node dims (``stride_<x>b``,
``stride_<x>h``, ``stride_<x>n``; unit stride over D), so that views of fairseq's time-first
[N, B, H, D] layout need no copy. Strides are int64 and the offsets built from them too
(a tensor may exceed 2^31 elements); they are specialised on divisibility by 16, which the
caller guarantees (a contiguous copy otherwise), so rows load in 16-byte vectors.
"""

import triton
import triton.language as tl

# scalars but the strides are never specialised (on divisibility by 16 or on being 1), and
# the strides always are multiples of 16 (never 1), so that the binaries launched are
# those that ``triton_aot`` compiles ahead of time.
# relative-key types per step of the dQ kernel's [rows, types] x [types, D] product
REL_TYPES_PER_STEP = tl.constexpr(16)
SCALARS = ["num_nodes", "num_types", "heads", "num_batch_heads", "scale", "dropout_threshold",
           "dropout_scale"]
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mix32(x):
    """The 32-bit finalizer of MurmurHash3: a bijection that spreads every input bit."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _keep(seed_ptr, bh, query_node, key_node, num_nodes, threshold):
    """Dropout keep bits of the (query_node, key_node) pairs (broadcast shapes); the seed is
    read from device memory, so that a captured CUDA graph draws a new one on each replay."""
    stream = _mix32(tl.load(seed_ptr).to(tl.uint32) ^ (bh.to(tl.uint32) * 0x9E3779B9))
    counter = query_node.to(tl.uint32) * num_nodes.to(tl.uint32) + key_node.to(tl.uint32)
    return (_mix32(counter ^ stream) >> 8).to(tl.int32) >= threshold


@triton.jit
def _flag(mask, flag):
    """``mask`` where the runtime ``flag`` is set, else all false (a splat of the flag: the
    interpreter rejects a mask broadcast from a scalar)."""
    return mask & (tl.full(mask.shape, flag, tl.int32) != 0)


@triton.jit
def _rounded(x, like_ptr, UPCAST: tl.constexpr):
    """fp32 ``x`` rounded to the element type of ``like_ptr`` as a GPU rounds it (to nearest
    even). Under ``UPCAST`` (the interpreter's bf16) kept in fp32 storage and rounded by its
    bits, since the interpreter's own cast truncates."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(like_ptr.dtype.element_ty)


@triton.jit
def _tile_scores(q, k, types, key_ok, rel_base, query_node, num_types, scale2,
                 PRECISION: tl.constexpr, HAS_REL: tl.constexpr, HAS_PAD: tl.constexpr):
    """Scores of one tile in base 2 (fp32, -inf off the graph or on an absent key) and the
    edge mask.

    ``q`` is [rows, D] and ``k`` [cols, D]; ``types`` [rows, cols] (-1 = no edge);
    ``key_ok`` (present keys, with ``HAS_PAD``) and ``query_node`` broadcast to it;
    ``scale2`` is the scale times log2(e)."""
    valid = types >= 0
    if HAS_PAD:
        valid = valid & key_ok
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
    if HAS_REL:  # gathered from the [N, T] table of scale * log2(e) * q . rel_key[t]; every
        # address is in it (query nodes are clamped to >= 0, no-edge types to 0), so without
        # a mask, whose predicate per element costs instructions (docs/design_notes.md)
        s += tl.load(rel_base + query_node * num_types + tl.maximum(types, 0))
    return tl.where(valid, s, float("-inf")), valid


@triton.jit
def _key_ok(pad_ptr, bh, heads, key_node, num_nodes, HAS_PAD: tl.constexpr):
    """Keys that exist and are present in this sentence ([len(key_node)] bool; without
    ``HAS_PAD``, the keys that exist)."""
    ok = key_node < num_nodes
    if HAS_PAD:
        absent = tl.load(pad_ptr + (bh // heads).to(tl.int64) * num_nodes + key_node, mask=ok,
                         other=1)
        ok = ok & (absent == 0)
    return ok


@triton.jit
def _head(ptr, bh, heads, stride_b, stride_h):
    """Where (sentence, head) ``bh`` of a [B, H, N, D] tensor starts (int64 offsets)."""
    return ptr + (bh // heads).to(tl.int64) * stride_b + (bh % heads).to(tl.int64) * stride_h


@triton.jit
def _row_offsets(nodes, stride_n, D: tl.constexpr):
    """[len(nodes), D] element offsets of rows ``nodes`` from a head's start (int64)."""
    return (nodes.to(tl.int64) * stride_n)[:, None] + tl.arange(0, D)[None, :]


@triton.jit
def _load_rows(base, nodes, stride_n, present, D: tl.constexpr, UPCAST: tl.constexpr):
    """[len(nodes), D] rows of one head's [N, D] matrix (zeros where not ``present``)."""
    x = tl.load(base + _row_offsets(nodes, stride_n, D), mask=present[:, None], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_columns(base, N: tl.constexpr, stride_n, present, D: tl.constexpr, UPCAST: tl.constexpr):
    """[D, N] the transposed N consecutive rows from ``base`` of one head's [N, D] matrix
    (zeros where not ``present``): a product's right operand loaded as it is used, which the
    compiler stages through shared memory, where it may hold a transpose of the loaded rows
    in registers (fp32 at head dim 128: 64 a thread, and their tf32 halves; the dQ kernel's
    binary without dQ spilled). Elsewhere the rows' transpose needs fewer registers."""
    x = tl.load(base + tl.arange(0, N)[None, :].to(tl.int64) * stride_n + tl.arange(0, D)[:, None],
                mask=present[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _query_rows(slot_node_ptr, block, BLOCK_M: tl.constexpr):
    """(graph node clamped to >= 0, row holds a node) of the rows of ``block`` in a
    [blocks, BLOCK_M] table of nodes (-1 = none): a query block's slots, a split block's rows."""
    node = tl.load(slot_node_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.maximum(node, 0), node >= 0


@triton.jit
def _store_rows(ptr, bh, heads, stride_b, stride_h, stride_n, nodes, present, x, D: tl.constexpr,
                UPCAST: tl.constexpr):
    """Write [len(nodes), D] rows ``x`` of head ``bh`` of a [B, H, N, D] tensor, in its dtype
    (rounded as a GPU rounds, ``_rounded``), where ``present``."""
    tl.store(_head(ptr, bh, heads, stride_b, stride_h) + _row_offsets(nodes, stride_n, D),
             _rounded(x, ptr, UPCAST).to(ptr.dtype.element_ty), mask=present[:, None])


@triton.jit
def _forward_tile(q, query_node, tile_start_ptr, tile, types_ptr, k_base, stride_kn, rel_base,
                  pad_ptr, bh, heads, num_nodes, num_types, scale2, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  HAS_REL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr):
    """(first key node, key nodes, keys, types, scores, edge mask) of one tile of a query
    block. Its keys are consecutive nodes: their rows are addressed from the first one's
    (one int64 product per tile, the columns' offsets small: fewer registers)."""
    cols = tl.arange(0, BLOCK_N)
    start = tl.load(tile_start_ptr + tile)
    key_node = start + cols
    key_ok = _key_ok(pad_ptr, bh, heads, key_node, num_nodes, HAS_PAD)
    k = _load_rows(k_base + start.to(tl.int64) * stride_kn, cols, stride_kn, key_node < num_nodes,
                   D, UPCAST)
    types = tl.load(types_ptr + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :])
    s, valid = _tile_scores(q, k, types, key_ok[None, :], rel_base, query_node[:, None],
                            num_types, scale2, PRECISION, HAS_REL, HAS_PAD)
    return start, key_node, k, types, s, valid


@triton.jit
def _item(items_ptr):
    """(block, first tile, end tile, part) of this program's work item."""
    item = items_ptr + tl.program_id(0) * 4
    return tl.load(item), tl.load(item + 1), tl.load(item + 2), tl.load(item + 3)


@triton.jit(do_not_specialize=SCALARS)
def forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    slot_node_ptr, items_ptr, tile_start_ptr, tile_types_ptr, rel_ptr, pad_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qn: tl.int64,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn: tl.int64,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn: tl.int64,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_on: tl.int64,
    num_nodes, num_types, heads, num_batch_heads, scale, seed_ptr, dropout_threshold, dropout_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_REL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """Output and log-sum-exp of one query block (or of a part of its tiles)."""
    block, first_tile, end_tile, part = _item(items_ptr)
    bh = tl.program_id(1)
    k_base = _head(k_ptr, bh, heads, stride_kb, stride_kh)
    v_base = _head(v_ptr, bh, heads, stride_vb, stride_vh)
    rows = tl.arange(0, BLOCK_M)
    query_node, row_present = _query_rows(slot_node_ptr, block, BLOCK_M)
    q = _load_rows(_head(q_ptr, bh, heads, stride_qb, stride_qh), query_node, stride_qn,
                   row_present, D, UPCAST)
    rel_base = rel_ptr + bh.to(tl.int64) * num_nodes * num_types
    scale2 = scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    types_ptr = tile_types_ptr + first_tile.to(tl.int64) * (BLOCK_M * BLOCK_N)
    for tile in range(first_tile, end_tile):
        start, key_node, k, types, s, valid = _forward_tile(
            q, query_node, tile_start_ptr, tile, types_ptr, k_base, stride_kn, rel_base, pad_ptr,
            bh, heads, num_nodes, num_types, scale2, D, BLOCK_M, BLOCK_N, PRECISION, HAS_REL,
            HAS_PAD, UPCAST)
        types_ptr += BLOCK_M * BLOCK_N
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys so far
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _keep(seed_ptr, bh, query_node[:, None], key_node[None, :], num_nodes,
                         dropout_threshold)
            p = tl.where(keep, p * dropout_scale, 0.0)
        v = _load_rows(v_base + start.to(tl.int64) * stride_vn, tl.arange(0, BLOCK_N), stride_vn,
                       key_node < num_nodes, D, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(_rounded(p, v_ptr, UPCAST), v,
                                            input_precision=PRECISION)
        m_i = m_new

    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = (m_i + tl.math.log2(tl.where(has_key, l_i, 1.0))) * LN2
    d = tl.arange(0, D)
    if part < 0:  # the block's only item: final rows; a row without a key has lse = +inf
        _store_rows(out_ptr, bh, heads, stride_ob, stride_oh, stride_on, query_node, row_present,
                    out, D, UPCAST)
        tl.store(lse_ptr + bh.to(tl.int64) * num_nodes + query_node,
                 tl.where(has_key, lse, float("inf")), mask=row_present)
    else:  # one part of a split block, merged by log-sum-exp afterwards (-inf = no key)
        offset = (part.to(tl.int64) * num_batch_heads + bh) * BLOCK_M
        tl.store(part_out_ptr + offset * D + rows[:, None] * D + d[None, :], out)
        tl.store(part_lse_ptr + offset + rows, tl.where(has_key, lse, float("-inf")))


@triton.jit
def _add_rel_term(grad_q, sums_ptr, present, rel_key_ptr, num_types, D: tl.constexpr):
    """``grad_q`` (fp32 [rows, D]) plus the rows' relative-key term sum_t sums[row, t] *
    rel_key[t] (``sums_ptr``: a pointer per row to its complete (row, type) sums; rel_key
    fp32 [T, D]), as products of ``REL_TYPES_PER_STEP`` types (tf32x3) in type order."""
    d = tl.arange(0, D)
    for first_type in range(0, num_types, REL_TYPES_PER_STEP):
        rel_type = first_type + tl.arange(0, REL_TYPES_PER_STEP)
        known = rel_type < num_types
        sums = tl.load(sums_ptr[:, None] + rel_type[None, :], mask=present[:, None] & known[None, :],
                       other=0.0)
        rel_key = tl.load(rel_key_ptr + rel_type[:, None] * D + d[None, :], mask=known[:, None], other=0.0)
        grad_q += tl.dot(sums, rel_key, input_precision="tf32x3")
    return grad_q


@triton.jit
def _rel_term(sums_ptr, present, rel_key_ptr, num_types, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_M, D] fp32 relative-key term sum_t sums[row, t] * rel_key[t] of rows whose
    complete (row, type) sums start at ``sums_ptr`` (a [BLOCK_M] pointer per row): one FMA
    per type, in type order (the dQ merge: no products, its fp32 sum kept in registers)."""
    term = tl.zeros([BLOCK_M, D], tl.float32)
    rel_key = rel_key_ptr + tl.arange(0, D)
    for rel_type in range(num_types):
        term += (tl.load(sums_ptr + rel_type, mask=present, other=0.0)[:, None]
                 * tl.load(rel_key + rel_type * D)[None, :])
    return term


@triton.jit
def _type_sums_rows(part, bh, query_node, num_nodes, num_types, num_batch_heads,
                    BLOCK_M: tl.constexpr):
    """[BLOCK_M] int64 offsets into grad_rel (``backward_query_kernel``) of the rows' type 0: a
    block done by one program sums into [BH, N, T], each part of a split block into its own
    [BLOCK_M, T] rows behind it (parts x BH of them), which the dQ merge adds in order."""
    behind = num_batch_heads.to(tl.int64) * num_nodes * num_types
    own = (part.to(tl.int64) * num_batch_heads + bh) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.where(part < 0, (bh.to(tl.int64) * num_nodes + query_node) * num_types,
                    behind + own * num_types)


@triton.jit(do_not_specialize=SCALARS)
def backward_query_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_q_ptr, part_grad_q_ptr,
    grad_rel_ptr, rel_key_ptr, slot_node_ptr, items_ptr, tile_start_ptr, tile_types_ptr,
    tile_type_start_ptr, tile_type_ids_ptr, rel_ptr, pad_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qn: tl.int64,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn: tl.int64,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn: tl.int64,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_on: tl.int64,
    stride_dob: tl.int64, stride_doh: tl.int64, stride_don: tl.int64,
    stride_dqb: tl.int64, stride_dqh: tl.int64, stride_dqn: tl.int64,
    num_nodes, num_types, heads, num_batch_heads, scale, seed_ptr, dropout_threshold, dropout_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_REL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr,
    GRAD_Q: tl.constexpr, REL_SUMS: tl.constexpr, REL_TERM: tl.constexpr,
):
    """dQ of one query block, in the input dtype, or of a part of a split block, in fp32
    (``GRAD_Q``; without, only the per-(row, type) sums below). Also writes Delta =
    rowsum(dO * O) of the block's rows, which the key kernel reads (every part of a split
    block, and each launch, writes the same values).

    With ``HAS_REL`` and ``REL_SUMS``, per tile and per edge type the tile holds (the plan's
    list, ascending), d(score) summed over the row's columns of that type, times scale, is
    added to the row's (row, type) sum in ``grad_rel_ptr`` (zeros before the first launch;
    its layout: ``_type_sums_rows``), from which d rel_key is computed: one store a step,
    with a barrier after it, in the plan's order; no atomics, the same bits on every run.
    With ``REL_TERM`` (fp16/bf16) a block done by one program then adds dQ's relative-key
    term from its rows' complete sums, in fp32 before dQ's one rounding (split blocks' rows:
    the dQ merge; fp32 dQ, never rounded: the caller, after the kernels).

    Where one binary doing both spills (``triton_backend.splits_rel_sums``), a launch with
    ``REL_SUMS`` alone makes the sums first and then one with ``GRAD_Q`` alone dQ."""
    block, first_tile, end_tile, part = _item(items_ptr)
    bh = tl.program_id(1)
    k_base = _head(k_ptr, bh, heads, stride_kb, stride_kh)
    v_base = _head(v_ptr, bh, heads, stride_vb, stride_vh)
    vector = bh.to(tl.int64) * num_nodes
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    query_node, row_present = _query_rows(slot_node_ptr, block, BLOCK_M)
    q = _load_rows(_head(q_ptr, bh, heads, stride_qb, stride_qh), query_node, stride_qn,
                   row_present, D, UPCAST)
    grad_out = _load_rows(_head(grad_out_ptr, bh, heads, stride_dob, stride_doh), query_node,
                          stride_don, row_present, D, UPCAST)
    lse2 = tl.load(lse_ptr + vector + query_node, mask=row_present, other=float("inf")) * LOG2E
    out = _load_rows(_head(out_ptr, bh, heads, stride_ob, stride_oh), query_node, stride_on,
                     row_present, D, UPCAST)
    delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(delta_ptr + vector + query_node, delta, mask=row_present)
    rel_base = rel_ptr + vector * num_types
    type_sums = grad_rel_ptr + _type_sums_rows(part, bh, query_node, num_nodes, num_types,
                                               num_batch_heads, BLOCK_M)
    sums_kept = row_present | (part >= 0)
    scale2 = scale * LOG2E

    if GRAD_Q:
        grad_q = tl.zeros([BLOCK_M, D], tl.float32)
    types_ptr = tile_types_ptr + first_tile.to(tl.int64) * (BLOCK_M * BLOCK_N)
    for tile in range(first_tile, end_tile):
        start, key_node, k, types, s, valid = _forward_tile(
            q, query_node, tile_start_ptr, tile, types_ptr, k_base, stride_kn, rel_base, pad_ptr,
            bh, heads, num_nodes, num_types, scale2, D, BLOCK_M, BLOCK_N, PRECISION, HAS_REL,
            HAS_PAD, UPCAST)
        types_ptr += BLOCK_M * BLOCK_N
        v_base_tile = v_base + start.to(tl.int64) * stride_vn
        if GRAD_Q:
            v = _load_rows(v_base_tile, tl.arange(0, BLOCK_N), stride_vn, key_node < num_nodes, D,
                           UPCAST)
            grad_p = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        else:  # the sums alone: v as columns (its rows' transpose would spill, see there)
            grad_p = tl.dot(grad_out, _load_columns(v_base_tile, BLOCK_N, stride_vn, key_node < num_nodes,
                                                    D, UPCAST), input_precision=PRECISION)
        p = tl.math.exp2(s - lse2[:, None])
        if DROPOUT:
            keep = _keep(seed_ptr, bh, query_node[:, None], key_node[None, :], num_nodes,
                         dropout_threshold)
            grad_p = tl.where(keep, grad_p * dropout_scale, 0.0)
        grad_s = p * (grad_p - delta[:, None])
        if GRAD_Q:
            grad_q += tl.dot(_rounded(grad_s, k_ptr, UPCAST), k, input_precision=PRECISION)
        if HAS_REL and REL_SUMS:
            # the types where a score is (the rest adds p = 0): in the scores' layout, so
            # that the loop below compares without moving the tile between layouts
            score_type = tl.where(s != float("-inf"), types, -1)
            for listed in range(tl.load(tile_type_start_ptr + tile),
                                tl.load(tile_type_start_ptr + tile + 1)):
                rel_type = tl.load(tile_type_ids_ptr + listed)
                by_type = tl.sum(tl.where(score_type == rel_type, grad_s, 0.0), 1)
                sums = type_sums + rel_type
                tl.store(sums, tl.load(sums, mask=sums_kept, other=0.0) + by_type * scale,
                         mask=sums_kept)
                # the next read of a sum may be another thread's (the compiler lays the
                # loads and stores out as it likes): the block's stores first
                tl.debug_barrier()

    if GRAD_Q:
        grad_q *= scale
        if part < 0:
            if HAS_REL and REL_TERM:  # the block's complete sums (scaled already)
                grad_q = _add_rel_term(grad_q, grad_rel_ptr + (vector + query_node) * num_types,
                                       row_present, rel_key_ptr, num_types, D)
            _store_rows(grad_q_ptr, bh, heads, stride_dqb, stride_dqh, stride_dqn, query_node,
                        row_present, grad_q, D, UPCAST)
        else:
            offset = (part.to(tl.int64) * num_batch_heads + bh) * BLOCK_M * D
            tl.store(part_grad_q_ptr + offset + rows[:, None] * D + d[None, :], grad_q)


@triton.jit(do_not_specialize=SCALARS + ["num_slots"])
def backward_key_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_k_ptr, grad_v_ptr,
    part_grad_k_ptr, part_grad_v_ptr, slot_node_ptr, num_slots, items_ptr, window_start_ptr,
    window_types_ptr, rel_ptr, pad_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qn: tl.int64,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn: tl.int64,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn: tl.int64,
    stride_dob: tl.int64, stride_doh: tl.int64, stride_don: tl.int64,
    stride_dkb: tl.int64, stride_dkh: tl.int64, stride_dkn: tl.int64,
    stride_dvb: tl.int64, stride_dvh: tl.int64, stride_dvn: tl.int64,
    num_nodes, num_types, heads, num_batch_heads, scale, seed_ptr, dropout_threshold, dropout_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_REL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """dK, dV of one aligned block of BLOCK_N key nodes (or a part of its windows of BLOCK_M
    query slots): the transposed tiles, so that every product has BLOCK_N rows. Written in
    the input dtype (a part of a split block in fp32, summed before the cast)."""
    block, first_window, end_window, part = _item(items_ptr)
    bh = tl.program_id(1)
    q_base = _head(q_ptr, bh, heads, stride_qb, stride_qh)
    grad_out_base = _head(grad_out_ptr, bh, heads, stride_dob, stride_doh)
    vector = bh.to(tl.int64) * num_nodes
    keys = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    key_node = block * BLOCK_N + keys
    key_exists = key_node < num_nodes
    key_ok = _key_ok(pad_ptr, bh, heads, key_node, num_nodes, HAS_PAD)
    k = _load_rows(_head(k_ptr, bh, heads, stride_kb, stride_kh), key_node, stride_kn,
                   key_exists, D, UPCAST)
    v = _load_rows(_head(v_ptr, bh, heads, stride_vb, stride_vh), key_node, stride_vn,
                   key_exists, D, UPCAST)
    rel_base = rel_ptr + vector * num_types
    scale2 = scale * LOG2E

    grad_k = tl.zeros([BLOCK_N, D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, D], tl.float32)
    types_ptr = window_types_ptr + first_window.to(tl.int64) * (BLOCK_M * BLOCK_N)
    for window in range(first_window, end_window):
        slot = tl.load(window_start_ptr + window) + rows
        query_node = tl.load(slot_node_ptr + slot, mask=slot < num_slots, other=-1)
        row_present = query_node >= 0
        query_node = tl.maximum(query_node, 0)
        q = _load_rows(q_base, query_node, stride_qn, row_present, D, UPCAST)
        grad_out = _load_rows(grad_out_base, query_node, stride_don, row_present, D, UPCAST)
        lse2 = tl.load(lse_ptr + vector + query_node, mask=row_present, other=float("inf")) * LOG2E
        delta = tl.load(delta_ptr + vector + query_node, mask=row_present, other=0.0)
        types = tl.load(types_ptr + keys[:, None] * BLOCK_M + rows[None, :])
        types_ptr += BLOCK_M * BLOCK_N
        # transposed tile: [keys, query rows]
        s, valid = _tile_scores(k, q, types, key_ok[:, None], rel_base, query_node[None, :],
                                num_types, scale2, PRECISION, HAS_REL, HAS_PAD)
        p = tl.math.exp2(s - lse2[None, :])
        grad_p = tl.dot(v, tl.trans(grad_out), input_precision=PRECISION)
        p_dropped = p
        if DROPOUT:
            keep = _keep(seed_ptr, bh, query_node[None, :], key_node[:, None], num_nodes,
                         dropout_threshold)
            p_dropped = tl.where(keep, p * dropout_scale, 0.0)
            grad_p = tl.where(keep, grad_p * dropout_scale, 0.0)
        grad_v += tl.dot(_rounded(p_dropped, grad_out_ptr, UPCAST), grad_out,
                         input_precision=PRECISION)
        grad_s = p * (grad_p - delta[None, :])
        grad_k += tl.dot(_rounded(grad_s, q_ptr, UPCAST), q, input_precision=PRECISION)

    grad_k *= scale
    d = tl.arange(0, D)
    if part < 0:
        _store_rows(grad_k_ptr, bh, heads, stride_dkb, stride_dkh, stride_dkn, key_node, key_exists,
                    grad_k, D, UPCAST)
        _store_rows(grad_v_ptr, bh, heads, stride_dvb, stride_dvh, stride_dvn, key_node, key_exists,
                    grad_v, D, UPCAST)
    else:
        offset = (part.to(tl.int64) * num_batch_heads + bh) * BLOCK_N * D
        offset += keys[:, None] * D + d[None, :]
        tl.store(part_grad_k_ptr + offset, grad_k)
        tl.store(part_grad_v_ptr + offset, grad_v)


# ------------------------------------------------- merging the parts of split blocks
#
# One program per (split block, batch x head): the block's parts, read in the plan's order
# (``part_index`` [split blocks, max parts], padded with ``num_parts``), are combined in fp32
# and its rows that are graph nodes (``split_nodes`` [split blocks, BLOCK_M], -1 = none)
# written once, through the target's strides, in its dtype. No atomics and a fixed order:
# the merges add no run-to-run variation. Part buffers are [parts, batch x head, BLOCK_M, D] fp32 (the
# log-sum-exp [parts, batch x head, BLOCK_M]), as the kernels above write them. The merges
# multiply no matrices (weights, sums, one FMA loop): nothing for the tensor cores.

MERGE_SCALARS = ["num_parts", "max_parts", "heads", "num_batch_heads"]


@triton.jit
def _part_offset(part, bh, num_parts, num_batch_heads, BLOCK_M: tl.constexpr):
    """(element offset (int64) of (part, bh)'s first row in a [parts, BH, BLOCK_M] buffer,
    the part is not padding): padding reads as masked loads of part 0, not as a branch (a
    branch in the loop makes ptxas spill)."""
    real = part < num_parts
    return (tl.where(real, part, 0).to(tl.int64) * num_batch_heads + bh) * BLOCK_M, real


@triton.jit
def _part_lse(part_lse_ptr, part, bh, num_parts, num_batch_heads, BLOCK_M: tl.constexpr):
    """[BLOCK_M] log-sum-exps of a part (-inf for padding: no keys)."""
    offset, real = _part_offset(part, bh, num_parts, num_batch_heads, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    return tl.load(part_lse_ptr + offset + rows, mask=_flag(rows < BLOCK_M, real),
                   other=float("-inf"))


@triton.jit
def _part_rows(parts_ptr, part, bh, num_parts, num_batch_heads, D: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """[BLOCK_M, D] fp32 rows of a part (zeros for padding)."""
    offset, real = _part_offset(part, bh, num_parts, num_batch_heads, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    return tl.load(parts_ptr + offset * D + rows[:, None] * D + tl.arange(0, D)[None, :],
                   mask=_flag(rows < BLOCK_M, real)[:, None], other=0.0)


@triton.jit
def _sum_parts(parts_ptr, part_index_ptr, bh, num_parts, max_parts, num_batch_heads,
               D: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_M, D] fp32 sum of this program's split block's parts, in the plan's order."""
    total = tl.zeros([BLOCK_M, D], tl.float32)
    index = part_index_ptr + tl.program_id(0) * max_parts
    for p in range(max_parts):
        total += _part_rows(parts_ptr, tl.load(index + p), bh, num_parts, num_batch_heads, D,
                            BLOCK_M)
    return total


@triton.jit(do_not_specialize=MERGE_SCALARS + ["num_nodes"])
def merge_forward_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, part_index_ptr, split_nodes_ptr,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_on: tl.int64,
    num_parts, max_parts, num_nodes, heads, num_batch_heads,
    D: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr,
):
    """Output and log-sum-exp of a split query block's rows from its parts' normalised
    outputs and log-sum-exps: out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m), lse =
    m + log(sum_p exp(lse_p - m)), m the rows' largest lse_p. A part without keys has lse_p =
    -inf (weight 0); a row without any key gets zeros and lse = +inf, as a block done by one
    program writes it."""
    bh = tl.program_id(1)
    node, present = _query_rows(split_nodes_ptr, tl.program_id(0), BLOCK_M)
    index = part_index_ptr + tl.program_id(0) * max_parts
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for p in range(max_parts):  # the largest log-sum-exp: weights at most 1
        m = tl.maximum(m, _part_lse(part_lse_ptr, tl.load(index + p), bh, num_parts,
                                    num_batch_heads, BLOCK_M))
    has_key = m > float("-inf")
    m = tl.where(has_key, m, 0.0)
    total = tl.zeros([BLOCK_M], tl.float32)
    out = tl.zeros([BLOCK_M, D], tl.float32)
    for p in range(max_parts):
        part = tl.load(index + p)
        weight = tl.exp(_part_lse(part_lse_ptr, part, bh, num_parts, num_batch_heads, BLOCK_M) - m)
        total += weight
        out += weight[:, None] * _part_rows(part_out_ptr, part, bh, num_parts, num_batch_heads, D,
                                            BLOCK_M)
    total = tl.where(has_key, total, 1.0)
    _store_rows(out_ptr, bh, heads, stride_ob, stride_oh, stride_on, node, present,
                out / total[:, None], D, UPCAST)
    tl.store(lse_ptr + bh.to(tl.int64) * num_nodes + node,
             tl.where(has_key, m + tl.log(total), float("inf")), mask=present)


@triton.jit(do_not_specialize=MERGE_SCALARS + ["num_nodes", "num_types"])
def merge_grad_q_kernel(
    grad_q_ptr, part_grad_q_ptr, part_index_ptr, split_nodes_ptr, grad_rel_ptr, rel_key_ptr,
    stride_dqb: tl.int64, stride_dqh: tl.int64, stride_dqn: tl.int64,
    num_parts, max_parts, num_nodes, num_types, heads, num_batch_heads,
    D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_REL: tl.constexpr, REL_TERM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dQ of a split query block's rows: the sum of its parts, rounded once; with ``HAS_REL``
    also the rows' per-(row, type) sums in grad_rel, the sums of the parts' own rows
    (``_type_sums_rows``), in the plan's order, and with ``REL_TERM`` (fp16/bf16) dQ's
    relative-key term from the merged sums (``rel_key_ptr``: fp32 [T, D]) before the
    rounding."""
    bh = tl.program_id(1)
    node, present = _query_rows(split_nodes_ptr, tl.program_id(0), BLOCK_M)
    if HAS_REL:  # (before dQ's sum: its registers are not held through these loops)
        index = part_index_ptr + tl.program_id(0) * max_parts
        target = grad_rel_ptr + (bh.to(tl.int64) * num_nodes + node) * num_types
        for p in range(max_parts):
            part = tl.load(index + p)
            real = part < num_parts
            rows = grad_rel_ptr + _type_sums_rows(tl.where(real, part, 0), bh, node, num_nodes,
                                                  num_types, num_batch_heads, BLOCK_M)
            for rel_type in range(num_types):
                sums = target + rel_type
                total = tl.load(sums, mask=_flag(present, p > 0), other=0.0)  # (the first part's replace)
                tl.store(sums, total + tl.load(rows + rel_type, mask=_flag(present, real), other=0.0),
                         mask=present)
            tl.debug_barrier()  # the next part's read of a sum may be another thread's
    grad_q = _sum_parts(part_grad_q_ptr, part_index_ptr, bh, num_parts, max_parts,
                        num_batch_heads, D, BLOCK_M)
    if HAS_REL and REL_TERM:
        grad_q += _rel_term(target, present, rel_key_ptr, num_types, D, BLOCK_M)
    _store_rows(grad_q_ptr, bh, heads, stride_dqb, stride_dqh, stride_dqn, node, present, grad_q,
                D, UPCAST)


@triton.jit(do_not_specialize=MERGE_SCALARS)
def merge_grad_kv_kernel(
    grad_k_ptr, grad_v_ptr, part_grad_k_ptr, part_grad_v_ptr, part_index_ptr, split_nodes_ptr,
    stride_dkb: tl.int64, stride_dkh: tl.int64, stride_dkn: tl.int64,
    stride_dvb: tl.int64, stride_dvh: tl.int64, stride_dvn: tl.int64,
    num_parts, max_parts, heads, num_batch_heads, D: tl.constexpr, BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dK and dV of a split key block's rows: the sums of their parts (one launch for both)."""
    bh = tl.program_id(1)
    node, present = _query_rows(split_nodes_ptr, tl.program_id(0), BLOCK_M)
    grad_k = _sum_parts(part_grad_k_ptr, part_index_ptr, bh, num_parts, max_parts,
                        num_batch_heads, D, BLOCK_M)
    _store_rows(grad_k_ptr, bh, heads, stride_dkb, stride_dkh, stride_dkn, node, present, grad_k,
                D, UPCAST)
    grad_v = _sum_parts(part_grad_v_ptr, part_index_ptr, bh, num_parts, max_parts,
                        num_batch_heads, D, BLOCK_M)
    _store_rows(grad_v_ptr, bh, heads, stride_dvb, stride_dvh, stride_dvn, node, present, grad_v,
                D, UPCAST)
