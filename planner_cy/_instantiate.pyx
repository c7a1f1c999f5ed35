"""Compiled core of instantiation and batch distribution (see instantiate.py for the model).

A template t is reduced to three numbers: its node count n_t and the two coefficients of its 1F1B
iteration time T_t(m) = base_t + (m - 1) * slope_t for m microbatches. Every routine here works on
those arrays only; planner_cy/ref_instantiate.py is the plain-Python statement of the same
semantics and the tests compare the two bit for bit.

Candidate values of the iteration time Z are the T_t(m), m in [1, limit]. `cap_of` counts the ones
at or below a value; searches over Z move between candidates with `_next_value` and never rely on
floating-point midpoints being candidates themselves.
"""

from libc.math cimport INFINITY, floor, nextafter
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

import numpy as np

include "_source_hash.pxi"


cdef inline double t_of(double base, double slope, int64_t m) noexcept nogil:
    # Evaluated the same way everywhere (ref_instantiate.t_of) so that equal candidates compare equal.
    return base + <double>(m - 1) * slope


cdef int64_t cap_of(double base, double slope, int64_t limit, double z) noexcept nogil:
    cdef double q
    cdef int64_t m
    if z < base:
        return 0
    if slope <= 0:
        return limit
    q = floor((z - base) / slope)
    if q >= <double>limit:
        m = limit
    else:
        m = <int64_t>q + 1
    # The division may round either way: settle on the exact count of T(m) <= z.
    while m < limit and t_of(base, slope, m + 1) <= z:
        m += 1
    while m > 0 and t_of(base, slope, m) > z:
        m -= 1
    return m


cdef double _next_value(int64_t nt, const double* base, const double* slope, const int64_t* limit, double z) noexcept nogil:
    """The smallest candidate value strictly above z (INFINITY when there is none)."""
    cdef double best = INFINITY
    cdef double v
    cdef int64_t t, c
    for t in range(nt):
        c = cap_of(base[t], slope[t], limit[t], z)
        if c < limit[t]:
            v = t_of(base[t], slope[t], c + 1)
            if v < best:
                best = v
    return best


cdef int64_t _weight(int64_t nt, const double* base, const double* slope, const int64_t* mult,
                     int64_t at_least, const int64_t* limit, double z) noexcept nogil:
    """sum_t mult_t * max(at_least, cap_t(z))."""
    cdef int64_t total = 0
    cdef int64_t t, c
    for t in range(nt):
        c = cap_of(base[t], slope[t], limit[t], z)
        if c < at_least:
            c = at_least
        total += mult[t] * c
    return total


cdef double _select(int64_t nt, const double* base, const double* slope, const int64_t* mult,
                    int64_t at_least, const int64_t* limit, double a, double b, int64_t r) noexcept nogil:
    """The smallest candidate v in (a, b] with weight(v) >= r, given weight(a) < r <= weight(b)."""
    cdef double p, mid
    while True:
        p = _next_value(nt, base, slope, limit, a)
        if p >= b or _weight(nt, base, slope, mult, at_least, limit, p) >= r:
            return p if p < b else b
        a = p
        mid = a + (b - a) * 0.5
        if a < mid < b:
            if _weight(nt, base, slope, mult, at_least, limit, mid) >= r:
                b = mid
            else:
                a = mid


cdef int64_t _fill(int64_t n_nodes, int64_t nt, const int64_t* sizes, const int64_t* caps, int64_t min_size,
                   int64_t kmin, int64_t width, bint saturate, int64_t* best, int64_t* chosen_k) noexcept nogil:
    """Knapsack over node counts: best[j, k] = the largest total capacity of k pipelines on exactly j nodes.

    With `saturate`, k = width - 1 stands for "at least width - 1 pipelines". Returns the best total
    capacity on n_nodes over the allowed k (at least kmin), -1 if none; the k is written to chosen_k.
    """
    cdef int64_t j, t, k, k2, n, c, v, row, prow, kmax, top
    for j in range((n_nodes + 1) * width):
        best[j] = -1
    best[0] = 0
    top = width - 1
    if top == 0 and saturate:  # no pipeline-count axis (the common case at scale): a plain exact-weight knapsack
        for j in range(1, n_nodes + 1):
            v = -1
            for t in range(nt):
                n = sizes[t]
                if caps[t] > 0 and n <= j and best[j - n] >= 0 and best[j - n] + caps[t] > v:
                    v = best[j - n] + caps[t]
            best[j] = v
        chosen_k[0] = 0 if best[n_nodes] >= 0 else -1
        return best[n_nodes] if kmin <= 0 else -1
    for j in range(1, n_nodes + 1):
        row = j * width
        for t in range(nt):
            c = caps[t]
            n = sizes[t]
            if c <= 0 or n > j:
                continue
            prow = (j - n) * width
            kmax = (j - n) // min_size
            if kmax > top:
                kmax = top
            for k in range(kmax + 1):
                v = best[prow + k]
                if v < 0:
                    continue
                k2 = k + 1
                if k2 > top:
                    if not saturate:
                        continue
                    k2 = top
                if v + c > best[row + k2]:
                    best[row + k2] = v + c
    v = -1
    chosen_k[0] = -1
    row = n_nodes * width
    for k in range(kmin, top + 1):
        if best[row + k] > v:
            v = best[row + k]
            chosen_k[0] = k
    return v


def max_pipelines(const int64_t[::1] sizes, int64_t n_nodes):
    """The most pipelines (of the given node counts) that use exactly n_nodes nodes; -1 if none do."""
    cdef int64_t nt = sizes.shape[0]
    cdef int64_t[::1] most = np.full(n_nodes + 1, -1, dtype=np.int64)
    cdef int64_t j, t
    with nogil:
        most[0] = 0
        for j in range(1, n_nodes + 1):
            for t in range(nt):
                if sizes[t] <= j and most[j - sizes[t]] >= 0 and most[j - sizes[t]] + 1 > most[j]:
                    most[j] = most[j - sizes[t]] + 1
    return int(most[n_nodes])


def pipeline_counts(const int64_t[::1] sizes, int64_t n_nodes, int64_t limit):
    """Flags, for k in 0..limit, whether k pipelines can use exactly n_nodes nodes."""
    cdef int64_t nt = sizes.shape[0]
    cdef int64_t width = limit + 1
    cdef unsigned char[::1] reach = np.zeros((n_nodes + 1) * width, dtype=np.uint8)
    cdef int64_t j, t, k, kmax, min_size = n_nodes + 1
    for t in range(nt):
        if sizes[t] < min_size:
            min_size = sizes[t]
    with nogil:
        reach[0] = 1
        for j in range(1, n_nodes + 1):
            for t in range(nt):
                if sizes[t] > j:
                    continue
                kmax = (j - sizes[t]) // min_size  # no more pipelines fit on the nodes before this one
                if kmax > limit - 1:
                    kmax = limit - 1
                for k in range(kmax + 1):
                    if reach[(j - sizes[t]) * width + k]:
                        reach[j * width + k + 1] = 1
    return np.asarray(reach[n_nodes * width:]).astype(bool)


def solve(const int64_t[::1] sizes, const double[::1] base, const double[::1] slope, const int64_t[::1] most_each,
          int64_t n_nodes, int64_t min_pipelines, int64_t microbatches, double upper=INFINITY):
    """The least iteration time Z and the pipeline count per template reaching it.

    Chooses x_t >= 0 with sum x_t * sizes_t = n_nodes and min_pipelines <= sum x_t <= microbatches,
    minimising Z = the smallest value at which the pipelines can take `microbatches` in total, each
    at least one and at most most_each_t (a memory limit; pass microbatches for none), none above Z.
    Among the choices reaching Z it keeps the one with the most total capacity at Z (the most slack
    for the batch split), ties going to templates listed first. Returns None when no choice exists.
    `upper`: a value believed feasible (a layout already known, e.g. a repair): the search starts
    below it when it is; the answer does not depend on it. Callers validate the arguments (instantiate.py).

    The search starts above a lower bound: n_nodes nodes take at most n_nodes * max_t cap_t(Z) / n_t
    microbatches, so some template reaches cap_t(Z) >= ceil(microbatches * n_t / n_nodes) =: m_t, and
    Z >= min_t T_t(m_t). Every candidate below that bound is infeasible.
    """
    cdef int64_t nt = sizes.shape[0]
    cdef int64_t most = max_pipelines(sizes, n_nodes)
    if most < 0:
        return None
    cdef bint saturate = most <= microbatches
    cdef int64_t width = (min_pipelines if saturate else microbatches) + 1
    cdef int64_t min_size = sizes[0]
    cdef int64_t t
    for t in range(nt):
        if sizes[t] < min_size:
            min_size = sizes[t]
    cdef int64_t* best = <int64_t*> malloc((n_nodes + 1) * width * sizeof(int64_t))
    cdef int64_t* caps = <int64_t*> malloc(nt * sizeof(int64_t))
    cdef int64_t* limit = <int64_t*> malloc(nt * sizeof(int64_t))
    cdef int64_t* ones = <int64_t*> malloc(nt * sizeof(int64_t))
    if best == NULL or caps == NULL or limit == NULL or ones == NULL:
        free(best); free(caps); free(limit); free(ones)
        raise MemoryError()
    cdef double lo = -INFINITY
    cdef double hi = -INFINITY
    cdef double probe, after, floor_z
    cdef int64_t w_lo, w_hi, chosen_k, value, j, k, kprev, n, c, p, need
    cdef bint found
    counts = np.zeros(nt, dtype=np.int64)
    cdef int64_t[::1] x = counts
    try:
        with nogil:
            for t in range(nt):
                ones[t] = 1
                limit[t] = most_each[t] if most_each[t] < microbatches else microbatches
                caps[t] = limit[t]
                if limit[t] > 0 and t_of(base[t], slope[t], limit[t]) > hi:
                    hi = t_of(base[t], slope[t], limit[t])
            value = -1
            if upper < hi:  # feasible there: the search starts below it, and the check at the top is not needed
                for t in range(nt):
                    caps[t] = cap_of(base[t], slope[t], limit[t], upper)
                value = _fill(n_nodes, nt, &sizes[0], caps, min_size, min_pipelines, width, saturate, best, &chosen_k)
                if value >= microbatches:
                    hi = upper
            if value < microbatches:
                # At hi every template takes all it can: only counts and memory limits can fail.
                for t in range(nt):
                    caps[t] = limit[t]
                value = _fill(n_nodes, nt, &sizes[0], caps, min_size, min_pipelines, width, saturate, best, &chosen_k)
        if value < microbatches:
            return None
        with nogil:
            floor_z = INFINITY
            for t in range(nt):
                need = (microbatches * sizes[t] + n_nodes - 1) // n_nodes
                if need <= limit[t] and t_of(base[t], slope[t], need) < floor_z:
                    floor_z = t_of(base[t], slope[t], need)
            if floor_z > hi:  # hi is feasible, so Z = hi
                floor_z = hi
            if floor_z < INFINITY:
                lo = nextafter(floor_z, -INFINITY)  # below the bound: infeasible, as the search needs
            while True:
                after = _next_value(nt, &base[0], &slope[0], limit, lo)
                if after >= hi:
                    break
                w_lo = _weight(nt, &base[0], &slope[0], ones, 0, limit, lo)
                w_hi = _weight(nt, &base[0], &slope[0], ones, 0, limit, hi)
                probe = _select(nt, &base[0], &slope[0], ones, 0, limit, lo, hi, w_lo + (w_hi - w_lo + 1) // 2)
                if probe >= hi:
                    probe = after
                for t in range(nt):
                    caps[t] = cap_of(base[t], slope[t], limit[t], probe)
                value = _fill(n_nodes, nt, &sizes[0], caps, min_size, min_pipelines, width, saturate, best, &chosen_k)
                if value >= microbatches:
                    hi = probe
                else:
                    lo = probe
            for t in range(nt):
                caps[t] = cap_of(base[t], slope[t], limit[t], hi)
            value = _fill(n_nodes, nt, &sizes[0], caps, min_size, min_pipelines, width, saturate, best, &chosen_k)
            # Walk back through the table: the first template (then the lower predecessor k) explaining the value.
            j = n_nodes
            k = chosen_k
            while j > 0:
                found = False
                for t in range(nt):
                    c = caps[t]
                    n = sizes[t]
                    if c <= 0 or n > j:
                        continue
                    for p in range(2):
                        if p == 0:
                            kprev = k - 1
                        elif saturate and k == width - 1:
                            kprev = k
                        else:
                            continue
                        if kprev < 0:
                            continue
                        if best[(j - n) * width + kprev] >= 0 and best[(j - n) * width + kprev] + c == best[j * width + k]:
                            x[t] += 1
                            j -= n
                            k = kprev
                            found = True
                            break
                    if found:
                        break
                if not found:
                    break
        if j != 0:
            raise AssertionError("instantiation table walk did not reach zero nodes")
        return hi, counts
    finally:
        free(best)
        free(caps)
        free(limit)
        free(ones)


def split(const double[::1] base, const double[::1] slope, const int64_t[::1] most_each, int64_t microbatches):
    """Microbatches per pipeline: between 1 and most_each_i each, summing to `microbatches`, water-filled.

    Every unit goes to the pipeline whose next iteration time T_i(nb_i + 1) is the smallest (ties to
    the lower index), which minimises the slowest pipeline and, after it, every other one. Returns
    None when the pipelines cannot hold the batch (len > microbatches or sum most_each < microbatches).
    """
    cdef int64_t k = base.shape[0]
    cdef int64_t i, c, left, extra, room = 0
    for i in range(k):
        room += most_each[i] if most_each[i] < microbatches else microbatches
        if most_each[i] < 1:
            return None
    if k < 1 or k > microbatches or room < microbatches:
        return None
    nb_array = np.ones(k, dtype=np.int64)
    cdef int64_t[::1] nb = nb_array
    cdef int64_t* ones = <int64_t*> malloc(k * sizeof(int64_t))
    cdef int64_t* limit = <int64_t*> malloc(k * sizeof(int64_t))
    if ones == NULL or limit == NULL:
        free(ones); free(limit)
        raise MemoryError()
    cdef double hi = -INFINITY
    cdef double theta
    try:
        with nogil:
            for i in range(k):
                ones[i] = 1
                limit[i] = most_each[i] if most_each[i] < microbatches else microbatches
                if t_of(base[i], slope[i], limit[i]) > hi:
                    hi = t_of(base[i], slope[i], limit[i])
            if k < microbatches:
                theta = _select(k, &base[0], &slope[0], ones, 1, limit, -INFINITY, hi, microbatches)
                left = microbatches
                for i in range(k):
                    # The values strictly below theta are all taken ...
                    if slope[i] <= 0:
                        c = limit[i] if base[i] < theta else 0
                    else:
                        c = cap_of(base[i], slope[i], limit[i], theta)
                        while c > 0 and t_of(base[i], slope[i], c) >= theta:
                            c -= 1
                    nb[i] = c if c > 1 else 1
                    left -= nb[i]
                for i in range(k):
                    # ... and the ties at theta go to the lowest indices.
                    if left <= 0:
                        break
                    c = cap_of(base[i], slope[i], limit[i], theta)
                    extra = c - nb[i]
                    if extra > left:
                        extra = left
                    if extra > 0:
                        nb[i] += extra
                        left -= extra
        return nb_array
    finally:
        free(ones)
        free(limit)


def dominated(const int64_t[::1] sizes, const double[::1] base, const double[::1] slope, const int64_t[::1] most_each):
    """Flags the templates that two others replace without loss: an exact pruning for `solve`.

    Template t is dominated when some a, b (a == b allowed, neither t) have n_a + n_b = n_t and, at every
    value z, both take a microbatch wherever t does and cap_a(z) + cap_b(z) >= cap_t(z). Then a plan using t
    does at least as well with a and b on the same nodes: one more pipeline (so f+1 still holds; callers
    prune only when every mix has at most as many pipelines as microbatches) and at least the capacity at
    its Z. cap_t is constant between its jumps T_t(1) < ... < T_t(limit_t), so checking those values is
    exhaustive. A template replaced by dominated ones is still dominated: the replacements are smaller, so
    the chain ends at kept ones. most_each: the memory limits, already capped at the batch.
    """
    cdef int64_t nt = sizes.shape[0], t, i, k, m, top = 0
    for t in range(nt):
        if sizes[t] > top:
            top = sizes[t]
    flags = np.zeros(nt, dtype=np.uint8)
    cdef unsigned char[::1] out = flags
    cdef int64_t[::1] index_of = np.full(top + 1, -1, dtype=np.int64)
    cdef double z
    cdef bint ok
    for t in range(nt):
        index_of[sizes[t]] = t
    with nogil:
        for t in range(nt):
            for i in range(nt):
                if i == t or 2 * sizes[i] > sizes[t]:
                    continue
                k = index_of[sizes[t] - sizes[i]]
                if k < 0 or k == t:
                    continue
                # every pipeline needs a microbatch: a and b must each take one wherever t does
                if base[i] > base[t] or base[k] > base[t] or most_each[i] < 1 or most_each[k] < 1:
                    continue
                ok = True
                for m in range(1, most_each[t] + 1):
                    z = t_of(base[t], slope[t], m)
                    if cap_of(base[i], slope[i], most_each[i], z) + cap_of(base[k], slope[k], most_each[k], z) < m:
                        ok = False
                        break
                if ok:
                    out[t] = 1
                    break
    return flags.astype(bool)
