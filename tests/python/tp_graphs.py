"""The seed's two tensor-parallel patterns as graph functions of world size W, with small tiles.

GEMM + Reduce-Scatter: rank r holds ``A[:, K_r]`` and ``B[K_r, :]`` and gets row block r of
``A @ B``. All-Gather + GEMM: rank r holds row block r of ``A`` and column block r of ``B`` and
gets column block r of ``A @ B``. Each factory builds the graph for one world size.

A tile that writes a symmetric tensor writes the copy of the rank it notifies: its TIRx body
addresses the tensor as its own (the rank kernel hands it the peer's copy), and its NumPy
reference writes ``peers[owner]``. Bodies read their rank as ``RANK`` and ``WORLD_SIZE``.
"""
from etc_tvm import RANK, WORLD_SIZE, ETensor, Tensor, call_device, device_func, graph_func
from tvm.script import tirx as T

TP = 4  # tile edge: TP x TP blocks
THREADS = 16
M, N, K, R, Q = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()


@device_func
def gemm_put_tile(i: T.int32, j: T.int32, A: T.Buffer((M, K), "float32"),
                  B: T.Buffer((K, N), "float32"), P: T.Buffer((R, Q, N), "float32")):
    """Partial product tile (i, j) of this rank's K slice, put into ``P[rank]`` on the owner
    of row tile i (rows ``[o*Q, (o+1)*Q)`` belong to rank o)."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    row = i * TP - i * TP // Q * Q + tx // TP  # within the owner's rows
    P[RANK, row, j * TP + tx % TP] = T.float32(0)
    for k in T.serial(K):
        P[RANK, row, j * TP + tx % TP] = (P[RANK, row, j * TP + tx % TP]
                                          + A[i * TP + tx // TP, k] * B[k, j * TP + tx % TP])


@gemm_put_tile.set_reference
def _(i, j, A, B, P, *, rank, peers):
    rows, cols = slice(i * TP, (i + 1) * TP), slice(j * TP, (j + 1) * TP)
    owner, local = divmod(i * TP, P.shape[1])
    peers[owner].P[rank, local:local + TP, cols] = A[rows] @ B[:, cols]


@device_func
def reduce_tile(i: T.int32, j: T.int32, P: T.Buffer((R, Q, N), "float32"),
                D: T.Buffer((Q, N), "float32")):
    """D tile (i, j) = the sum of the R partials that the ranks put into P."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    D[i * TP + tx // TP, j * TP + tx % TP] = T.float32(0)
    for r in T.serial(R):
        D[i * TP + tx // TP, j * TP + tx % TP] = (D[i * TP + tx // TP, j * TP + tx % TP]
                                                  + P[r, i * TP + tx // TP, j * TP + tx % TP])


@reduce_tile.set_reference
def _(i, j, P, D):
    rows, cols = slice(i * TP, (i + 1) * TP), slice(j * TP, (j + 1) * TP)
    D[rows, cols] = P[:, rows, cols].sum(axis=0)


def gemm_reduce_scatter(world_size: int, wait_count="W", notify: str = "ij->ij",
                        counts: bool = False):
    """GEMM + Reduce-Scatter on ``world_size`` ranks, tile-level pipelined: GEMM tile (i, j)
    notifies ``E[i, j]`` on the owner of row tile i (E sharded on rows, one notify from each
    rank), whose reduce tile (i, j) waits on its ``E.local_view()``. ``wait_count``,
    ``notify`` and ``counts`` (the counts as an int32 input, known at run time) make the
    broken variants the tests need."""
    W = world_size
    count = W if wait_count == "W" else wait_count

    def body(A, B, count_tensor=None):
        Mg, Ng = A.shape[0], B.shape[1]
        E = ETensor(count_tensor.shape if counts else (Mg // TP, Ng // TP),
                    wait_count=count_tensor if counts else count, shard="S[0]", name="E")
        P = call_device(gemm_put_tile, tile_num=(Mg // TP, Ng // TP), args=[A, B],
                        out=Tensor((W, Mg // W, Ng), name="partials", symmetric=True),
                        out_edges={E: notify})
        return call_device(reduce_tile, tile_num=(Mg // W // TP, Ng // TP), args=[P],
                           out=Tensor((Mg // W, Ng), name="D"),
                           in_edges={E.local_view(): "ij->ij"})

    if counts:
        @graph_func(world_size=W)
        def gemm_rs(A: Tensor(("M", "K")), B: Tensor(("K", "N")),
                    E_counts: Tensor(("Mt", "Nt"), "int32")):
            return body(A, B, E_counts)
    else:
        @graph_func(world_size=W)
        def gemm_rs(A: Tensor(("M", "K")), B: Tensor(("K", "N"))):
            return body(A, B)
    return gemm_rs


@device_func
def gather_tile(p: T.int32, i: T.int32, A: T.Buffer((M, K), "float32"),
                G: T.Buffer((R, M, K), "float32")):
    """Row tile i of this rank's A, put into ``G[rank]`` on rank p."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    for k in T.serial(K):
        if tx < TP:
            G[RANK, i * TP + tx, k] = A[i * TP + tx, k]


@gather_tile.set_reference
def _(p, i, A, G, *, rank, peers):
    rows = slice(i * TP, (i + 1) * TP)
    peers[p].G[rank, rows] = A[rows]


@device_func
def ring_gemm_tile(s: T.int32, i: T.int32, j: T.int32, G: T.Buffer((R, M, K), "float32"),
                   B: T.Buffer((K, N), "float32"), C: T.Buffer((Q, N), "float32")):
    """C tile (i, j) of source rank ``(rank + s) % world_size``'s rows: gathered A rows times
    this rank's B columns."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    src = (RANK + s) % WORLD_SIZE
    C[src * M + i * TP + tx // TP, j * TP + tx % TP] = T.float32(0)
    for k in T.serial(K):
        C[src * M + i * TP + tx // TP, j * TP + tx % TP] = (
            C[src * M + i * TP + tx // TP, j * TP + tx % TP]
            + G[src, i * TP + tx // TP, k] * B[k, j * TP + tx % TP])


@ring_gemm_tile.set_reference
def _(s, i, j, G, B, C, *, rank, world_size):
    src = (rank + s) % world_size
    rows, cols = slice(i * TP, (i + 1) * TP), slice(j * TP, (j + 1) * TP)
    m = G.shape[1]
    C[src * m + i * TP:src * m + (i + 1) * TP, cols] = G[src, rows] @ B[:, cols]


def all_gather_gemm(world_size: int, gather: str = "pi->p, rank"):
    """All-Gather + GEMM on ``world_size`` ranks: gather task (p, i) puts row tile i of this
    rank's A into ``G[rank]`` on rank p and notifies ``E[p, rank]`` there (E sharded on rows:
    row p is rank p's, element (p, src) counts src's row tiles). GEMM tiles walk the sources
    in ring order ``rank, rank + 1, ...``, each waiting on its source's element, so a rank
    starts on its own rows while the others' are in flight. ``gather`` makes broken
    variants."""
    W = world_size

    @graph_func(world_size=W)
    def ag_gemm(A: Tensor(("M", "K")), B: Tensor(("K", "N"))):
        Mr, Nr = A.shape[0], B.shape[1]
        E = ETensor((W, W), shard="S[0]", name="E")
        G = call_device(gather_tile, tile_num=(W, Mr // TP), args=[A],
                        out=Tensor((W, Mr, A.shape[1]), name="gathered", symmetric=True),
                        out_edges={E: gather})
        return call_device(ring_gemm_tile, tile_num=(W, Mr // TP, Nr // TP), args=[G, B],
                           out=Tensor((W * Mr, Nr), name="C"),
                           in_edges={E.local_view(): "sij->0, (rank + s) % world_size"})

    return ag_gemm
