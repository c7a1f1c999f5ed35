"""Exact pipeline-template search, compiled (typed boundary: _templates.pyi; reference: ref_templates.py).

One pass computes the best template of every node count 1..max_nodes. The cost model, the units and
the tie-break are documented in templates.py; this module only executes them.

Why a Pareto DP: T(m) = total + (m - 1) * peak, where total sums stage times and communication and peak
is the slowest stage. The objective does not decompose over stages, so keeping one best suffix per state
(what Oobleck's planner does) is a heuristic. Keeping, per state, every suffix that no other suffix beats
in both total and peak is exact: the best completion of a dominated suffix is never better than the same
completion of the suffix that dominates it.

Suffix state (i, c, u, p): layers [i, L) remain; their first stage sits on a node of which u GPUs are
still free for this suffix, followed by c whole nodes; p = number of stages in the suffix, capped at K.
The cap is exact: K is the smallest position from which no stage's memory verdict changes any more
(memory_cap), so positions >= K are interchangeable.

Tensor parallelism: a stage (i, j, g) at position p runs at the degree t of least time among those that fit
at p (best_time). A slower degree never completes an optimum (the faster one, same suffix, is strictly better),
so the fronts need only that least time, and the walk tries degrees smallest first for the tie-break.
"""

from libc.stdint cimport INT64_MAX, int32_t, int64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memmove, memset

include "_source_hash.pxi"

# Everything is integer: times in units of 1/G nanosecond (so that a stage's time on g GPUs,
# ticks * (G / g), stays exact), bytes as bytes. Exact integers make ties real ties, so the documented
# tie-break decides them rather than rounding noise, identically here and in ref_templates.py.


cdef inline int64_t state_index(const Tables* t, int i, int c, int u, int p) noexcept nogil:
    return ((<int64_t>i * t.max_nodes + c) * t.gpus + (u - 1)) * t.positions + (p - 1)


cdef inline int lowest_tp(const Tables* t, int g) noexcept nogil:
    """The least degree a stage of g GPUs may take: its g / t groups must split the microbatch evenly."""
    return g // t.max_dp if g > t.max_dp else 1


cdef inline int highest_tp(const Tables* t, int g) noexcept nogil:
    return g if g < t.max_tp else t.max_tp


cdef inline int level(int tp) noexcept nogil:
    """k with 2**k == tp: the row of time_pf."""
    cdef int k = 0
    while (1 << k) < tp:
        k += 1
    return k


cdef inline int64_t degree_time(const Tables* t, int i, int j, int g, int tp, int k) noexcept nogil:
    # units of 1/G ns: ticks_t * t / g * G, exact because g divides G; k: the row of degree tp (tp == 2**k)
    cdef int64_t row = <int64_t>k * (t.num_layers + 1)
    return (t.time_pf[row + j] - t.time_pf[row + i]) * (t.gpus // g) * tp


cdef inline int64_t stage_time(const Tables* t, int i, int j, int g, int tp) noexcept nogil:
    return degree_time(t, i, j, g, tp, level(tp))


cdef inline bint fits(const Tables* t, int i, int j, int g, int tp, int p) noexcept nogil:
    # every GPU of the stage: state / t + min(p, m) * (split / t + replicated) * t / g <= memory, times g
    cdef int64_t inflight = p if p < t.m_ref else t.m_ref
    cdef int64_t act = t.act_pf[j] - t.act_pf[i]
    if tp > 1:
        act += (tp - 1) * (t.rep_pf[j] - t.rep_pf[i])
    return (g // tp) * (t.state_pf[j] - t.state_pf[i]) + inflight * act <= g * t.memory


cdef inline int64_t plain_time(const Tables* t, int i, int j, int g, int p) noexcept nogil:
    """best_time when max_tp == 1: the rule without TP, nothing to choose (the hot loops' fast path)."""
    cdef int64_t inflight = p if p < t.m_ref else t.m_ref
    if g * (t.state_pf[j] - t.state_pf[i]) + inflight * (t.act_pf[j] - t.act_pf[i]) > g * t.memory:
        return -1
    return (t.time_pf[j] - t.time_pf[i]) * (t.gpus // g)


cdef inline int64_t best_time(const Tables* t, int i, int j, int g, int p) noexcept nogil:
    """The least time of layers [i, j) on g GPUs over the degrees that fit at position p; -1: none fits.

    Non-decreasing in j (each degree's time grows, and fewer degrees fit), so callers may stop at the first -1.
    """
    cdef int tp = lowest_tp(t, g), top = highest_tp(t, g), k = level(tp)
    cdef int64_t best = -1, st
    if tp == top:  # one degree (always without tensor parallelism)
        return degree_time(t, i, j, g, tp, k) if fits(t, i, j, g, tp, p) else -1
    while tp <= top:
        if fits(t, i, j, g, tp, p):
            st = degree_time(t, i, j, g, tp, k)
            if best < 0 or st < best:
                best = st
        tp *= 2
        k += 1
    return best


cdef inline int top_power(const Tables* t, int u) noexcept nogil:
    """The most GPUs a stage may take from u free ones: the largest power of two <= min(u, max_gpus)."""
    cdef int g = 1
    while g * 2 <= u and g * 2 <= t.max_gpus:
        g *= 2
    return g


cdef int memory_cap(const Tables* t) noexcept nogil:
    """K = 1 + the largest last-feasible position below m_ref over all stages (i, j, g, t), at most L."""
    cdef int L = t.num_layers, i, j, g, tp
    cdef int64_t room, act, last, worst = 0
    for i in range(L):
        g = 1
        while g <= t.max_gpus:
            tp = lowest_tp(t, g)
            while tp <= highest_tp(t, g):
                for j in range(i + 1, L + 1):
                    room = g * t.memory - (g // tp) * (t.state_pf[j] - t.state_pf[i])
                    act = t.act_pf[j] - t.act_pf[i] + (tp - 1) * (t.rep_pf[j] - t.rep_pf[i])
                    if room < 0:
                        break  # longer stages hold even more state: all infeasible, last position 0
                    last = t.m_ref if act == 0 else room // act
                    if last < t.m_ref and last > worst:
                        worst = last
                tp *= 2
            g *= 2
    return <int>(worst + 1 if worst + 1 < L else L)


cdef int64_t min_total(const Tables* t, const Fronts* fronts, int i, int c, int u, int p, int64_t peak_bound) noexcept nogil:
    """The least total of a suffix from state (i, c, u, p) whose peak is <= peak_bound; INT64_MAX if none."""
    cdef int64_t s = state_index(t, i, c, u, p)
    cdef const Entry* front = fronts.pool + fronts.offset[s]
    cdef int lo = 0, hi = fronts.count[s], mid
    while lo < hi:  # first entry with peak > bound
        mid = (lo + hi) // 2
        if front[mid].peak <= peak_bound:
            lo = mid + 1
        else:
            hi = mid
    return front[lo - 1].total if lo > 0 else INT64_MAX


cdef int insert(Buffer* b, int64_t total, int64_t peak) noexcept nogil:
    """Add a candidate to a front, dropping it if dominated and dropping what it dominates; -1: no memory."""
    cdef int64_t lo = 0, hi = b.size, mid, start, end, grow
    cdef Entry* data = b.data
    while lo < hi:
        mid = (lo + hi) // 2
        if data[mid].peak <= peak:
            lo = mid + 1
        else:
            hi = mid
    if lo > 0 and data[lo - 1].total <= total:
        return 0
    start = lo - 1 if lo > 0 and data[lo - 1].peak == peak else lo
    end = lo
    while end < b.size and data[end].total >= total:
        end += 1
    grow = 1 - (end - start)
    if b.size + grow > b.capacity:
        data = <Entry*>realloc(b.data, (b.capacity * 2 + 16) * sizeof(Entry))
        if data == NULL:
            return -1
        b.data = data
        b.capacity = b.capacity * 2 + 16
    memmove(&data[start + 1], &data[end], (b.size - end) * sizeof(Entry))
    data[start].total = total
    data[start].peak = peak
    b.size += grow
    return 0


cdef int merge(Buffer* b, const Tables* t, const Fronts* fronts, int64_t sub, int64_t stage, int64_t comm,
               int64_t bound) noexcept nogil:
    """Prepend a stage (time `stage`, then `comm` to the next) to every suffix of state `sub`.

    Suffixes with total + (m - 1) * peak > bound are dropped: no template can finish them in time.
    """
    cdef const Entry* front = fronts.pool + fronts.offset[sub]
    cdef int n = fronts.count[sub], k = 0
    cdef int64_t head = stage + comm, m1 = t.m_ref - 1
    while k < n and front[k].peak <= stage:
        k += 1
    if k > 0 and head + front[k - 1].total + m1 * stage <= bound:  # all these peak at `stage`: keep the least total
        if insert(b, head + front[k - 1].total, stage) < 0:
            return -1
    while k < n:
        if head + front[k].total + m1 * front[k].peak <= bound and insert(b, head + front[k].total, front[k].peak) < 0:
            return -1
        k += 1
    return 0


cdef void least_times(const Tables* t, int64_t* least_pf) noexcept nogil:
    """least_pf[l]: a lower bound on the time of layers [0, l) in any layout: sum of min over t of ticks_t * t."""
    cdef int L = t.num_layers, l, tp, k
    cdef int64_t best, here
    least_pf[0] = 0
    for l in range(L):
        best = -1
        tp = 1
        k = 0
        while tp <= t.max_tp:
            here = (t.time_pf[<int64_t>k * (L + 1) + l + 1] - t.time_pf[<int64_t>k * (L + 1) + l]) * tp
            if best < 0 or here < best:
                best = here
            tp *= 2
            k += 1
        least_pf[l + 1] = least_pf[l] + best


cdef void upper_bounds(const Tables* t, int64_t* bound) noexcept nogil:
    """bound[c] >= the optimal T(m_ref) of every template of more than c nodes; INT64_MAX: unknown.

    From a feasible layout per node count: every node split into R = G / max_gpus stages of max_gpus GPUs
    (one stage of G GPUs when no cap applies), each at its best degree, the least peak (then the least total) by a plain DP over
    (first layer, stages left). The exact search may then drop any suffix whose own total + (m - 1) * peak,
    plus the least time of the layers before it, exceeds the bound of its state.
    """
    cdef int L = t.num_layers, C = t.max_nodes, R = t.gpus // t.max_gpus, i, j, c, n, k
    cdef int KK = C * R
    cdef int64_t st, peak, total, at, nxt
    cdef int64_t* best_peak = <int64_t*>malloc(<int64_t>(L + 1) * KK * sizeof(int64_t))
    cdef int64_t* best_total = <int64_t*>malloc(<int64_t>(L + 1) * KK * sizeof(int64_t))
    for c in range(C):
        bound[c] = INT64_MAX
    if best_peak == NULL or best_total == NULL:
        free(best_peak)
        free(best_total)
        return
    for k in range(1, KK + 1):  # best_*[i * KK + k - 1]: layers [i, L) as k stages, -1: none fits
        for i in range(L - 1, -1, -1):
            at = <int64_t>i * KK + k - 1
            best_peak[at] = -1
            for j in range(i + 1, L - k + 2):
                st = best_time(t, i, j, t.max_gpus, k) if t.max_tp > 1 else plain_time(t, i, j, t.max_gpus, k)
                if st < 0:
                    break  # longer stages hold more state
                if k == 1:
                    if j == L:
                        best_peak[at] = st
                        best_total[at] = st
                    continue
                nxt = <int64_t>j * KK + k - 2
                if best_peak[nxt] < 0:
                    continue
                peak = st if st > best_peak[nxt] else best_peak[nxt]
                # the k - 1 stages after this one start a new node when k - 1 is a multiple of R
                total = st + (t.comm_inter[j - 1] if (k - 1) % R == 0 else t.comm_intra[j - 1]) + best_total[nxt]
                if best_peak[at] < 0 or peak < best_peak[at] or (peak == best_peak[at] and total < best_total[at]):
                    best_peak[at] = peak
                    best_total[at] = total
    for n in range(C, 0, -1):  # bound[c] = the largest bound of n = c + 1 .. C nodes
        at = n * R - 1
        if best_peak[at] < 0:
            bound[n - 1] = INT64_MAX
        else:
            bound[n - 1] = best_total[at] + (t.m_ref - 1) * best_peak[at]
        if n < C and bound[n] > bound[n - 1]:
            bound[n - 1] = bound[n]
    free(best_peak)
    free(best_total)


cdef void fill_stage_times(const Tables* t, int i, StageTimes* times) noexcept nogil:
    """best_time of every stage [i, j) per GPU count and position, once per i (it depends on neither c nor u)."""
    cdef int L = t.num_layers, K = t.positions, gk, p, j
    cdef int64_t row, st
    for gk in range(times.levels):
        for p in range(1, K + 1):
            row = <int64_t>gk * K + p - 1
            times.reach[row] = i
            for j in range(i + 1, L + 1):
                st = best_time(t, i, j, 1 << gk, p)
                if st < 0:
                    break  # longer stages never fit either (best_time)
                times.time[row * (L + 1) + j] = st
                times.reach[row] = j


cdef inline int64_t cached_time(const Tables* t, const StageTimes* times, int i, int j, int g, int p) noexcept nogil:
    """best_time(i, j, g, p), from the table filled for i when there is one (-1: none fits).

    Without tensor parallelism (max_tp == 1) there is no table: one degree per stage is as cheap to compute.
    """
    cdef int64_t row
    if times.levels == 0:
        return plain_time(t, i, j, g, p)
    row = <int64_t>level(g) * t.positions + p - 1
    return times.time[row * (t.num_layers + 1) + j] if j <= times.reach[row] else -1


cdef int build_fronts(const Tables* t, Fronts* fronts, StageTimes* times) noexcept nogil:
    """Fill the front of every suffix state, from the last layer backwards; -1: out of memory."""
    cdef int L = t.num_layers, G = t.gpus, K = t.positions
    cdef int i, c, u, p, g, j, j_hi, c2, u2, q, fewest, most
    cdef int64_t s, st, cm, limit
    cdef Entry* grown
    cdef Buffer b
    cdef int64_t* bound = <int64_t*>malloc(t.max_nodes * sizeof(int64_t))
    cdef int64_t* least_pf = <int64_t*>malloc((L + 1) * sizeof(int64_t))
    if bound == NULL or least_pf == NULL:
        free(bound)
        free(least_pf)
        return -1
    least_times(t, least_pf)
    upper_bounds(t, bound)
    b.size = 0
    b.capacity = 64
    b.data = <Entry*>malloc(b.capacity * sizeof(Entry))
    if b.data == NULL:
        free(bound)
        free(least_pf)
        return -1
    for i in range(L - 1, -1, -1):
        if times.levels > 0:
            fill_stage_times(t, i, times)
        for c in range(t.max_nodes):
            # the layers before i take at least least_pf[i] (units >= ticks * t), so a suffix may spend the rest
            limit = bound[c] - least_pf[i] if bound[c] != INT64_MAX else INT64_MAX
            for u in range(1, G + 1):
                fewest = c + 1  # stages in the suffix: one per node at least, one per GPU or layer at most
                most = c * G + u
                if most > L - i:
                    most = L - i
                for p in range(1, K + 1):
                    s = state_index(t, i, c, u, p)
                    fronts.offset[s] = fronts.size
                    fronts.count[s] = 0
                    if fewest > most or (p < K and not fewest <= p <= most) or (p == K and most < K):
                        continue
                    b.size = 0
                    g = top_power(t, u)
                    while g >= 1:
                        if u > g:
                            c2 = c
                            u2 = u - g
                            j_hi = L - 1 - c
                        elif c > 0:
                            c2 = c - 1
                            u2 = G
                            j_hi = L - c
                        else:
                            c2 = 0
                            u2 = 0
                            j_hi = i  # the stage must end the pipeline
                        if p > 1 or K == 1:  # a stage before others (p == 1 means exactly one stage unless K == 1)
                            for j in range(i + 1, j_hi + 1):
                                st = cached_time(t, times, i, j, g, p)
                                if st < 0:
                                    break
                                if limit != INT64_MAX and st * t.m_ref > limit:
                                    break  # total >= st and peak >= st; longer stages only take longer
                                cm = t.comm_intra[j - 1] if u > g else t.comm_inter[j - 1]
                                # the suffix after this stage has p - 1 stages, or any count >= K - 1 when capped
                                q = p - 1 if p < K else K - 1
                                while q <= (p - 1 if p < K else K):
                                    if q >= 1 and merge(&b, t, fronts, state_index(t, j, c2, u2, q), st, cm, limit) < 0:
                                        free(b.data)
                                        free(bound)
                                        free(least_pf)
                                        return -1
                                    q += 1
                        if p == 1 and c == 0 and u == g:
                            st = cached_time(t, times, i, L, g, 1)
                            if st >= 0 and st * t.m_ref <= limit and insert(&b, st, st) < 0:
                                free(b.data)
                                free(bound)
                                free(least_pf)
                                return -1
                        g //= 2
                    if fronts.size + b.size > fronts.capacity:
                        grown = <Entry*>realloc(fronts.pool, (fronts.capacity * 2 + b.size) * sizeof(Entry))
                        if grown == NULL:
                            free(b.data)
                            free(bound)
                            free(least_pf)
                            return -1
                        fronts.pool = grown
                        fronts.capacity = fronts.capacity * 2 + b.size
                    memmove(fronts.pool + fronts.size, b.data, b.size * sizeof(Entry))
                    fronts.count[s] = <int32_t>b.size
                    fronts.size += b.size
    free(b.data)
    free(bound)
    free(least_pf)
    return 0


cdef bint follow(const Tables* t, const Fronts* fronts, int i, int j, int g, int tp, int c, int u, int64_t best_peak,
                 int64_t remaining, const unsigned char* current, unsigned char* upcoming) noexcept nogil:
    """Whether stage [i, j) on g GPUs at degree tp, from a live state, completes the optimum.

    Marks in `upcoming` the live positions of the suffix after it (none when it ends the pipeline).
    """
    cdef int L = t.num_layers, G = t.gpus, K = t.positions, p, q
    cdef int c2 = c if u > g else c - 1  # -1: no node left after this one
    cdef int u2 = u - g if u > g else G
    cdef int64_t st = stage_time(t, i, j, g, tp)
    cdef int64_t cm = t.comm_intra[j - 1] if u > g else t.comm_inter[j - 1]
    cdef bint more = False
    if st > best_peak:
        return False
    memset(upcoming, 0, K + 1)
    for p in range(1, K + 1):
        if not current[p] or not fits(t, i, j, g, tp, p):
            continue
        if j == L:
            if p == 1 and c == 0 and u == g and st == remaining:
                return True
        elif c2 >= 0 and j <= L - 1 - c2 and (p > 1 or K == 1):
            q = p - 1 if p < K else K - 1
            while q <= (p - 1 if p < K else K):
                if q >= 1 and min_total(t, fronts, j, c2, u2, q, best_peak) == remaining - st - cm:
                    upcoming[q] = 1
                    more = True
                q += 1
    return more


cdef int reconstruct(const Tables* t, const Fronts* fronts, int nodes, int64_t* objective, int64_t* peak,
                     int32_t* ends, int32_t* gpus, int32_t* degrees) noexcept nogil:
    """Write the best template of `nodes` nodes; returns its stage count, 0 if none fits, -1 on a bug.

    Best = least objective, then least peak, then the lexicographically first stage sequence (stage by
    stage from the first: the earlier end layer, then the more GPUs, then the smaller degree). The walk keeps
    every suffix state (one per capped position) that still completes the optimum, so the choice is global.
    """
    cdef int L = t.num_layers, G = t.gpus, K = t.positions
    cdef int64_t m1 = t.m_ref - 1, best = -1, best_peak = 0, total, remaining
    cdef int i = 0, c = nodes - 1, u = G, p, q, j = 0, g = 0, tp = 0, k = 0
    cdef bint chosen, within
    cdef int64_t s
    cdef const Entry* front
    cdef unsigned char* current
    cdef unsigned char* upcoming
    cdef unsigned char* swap
    if nodes > L or c >= t.max_nodes:
        return 0
    for p in range(1, K + 1):
        s = state_index(t, 0, c, G, p)
        front = fronts.pool + fronts.offset[s]
        for q in range(fronts.count[s]):
            total = front[q].total + m1 * front[q].peak
            if best < 0 or total < best or (total == best and front[q].peak < best_peak):
                best = total
                best_peak = front[q].peak
    if best < 0:
        return 0
    objective[0] = best
    peak[0] = best_peak
    remaining = best - m1 * best_peak
    current = <unsigned char*>calloc(K + 1, 1)
    upcoming = <unsigned char*>calloc(K + 1, 1)
    if current == NULL or upcoming == NULL:
        free(current)
        free(upcoming)
        return -1
    for p in range(1, K + 1):
        current[p] = min_total(t, fronts, 0, c, G, p, best_peak) == remaining
    while True:
        chosen = False
        for j in range(i + 1, L + 1):
            within = False  # some stage [i, j) is no slower than the optimum's slowest one
            g = top_power(t, u)
            while g >= 1 and not chosen:
                tp = lowest_tp(t, g)
                while tp <= highest_tp(t, g) and not chosen:
                    if stage_time(t, i, j, g, tp) <= best_peak:
                        within = True
                        chosen = follow(t, fronts, i, j, g, tp, c, u, best_peak, remaining, current, upcoming)
                    if not chosen:
                        tp *= 2
                if not chosen:
                    g //= 2
            if chosen or not within:
                break  # not within: every longer stage is slower still (times only grow with j)
        if not chosen:
            free(current)
            free(upcoming)
            return -1
        ends[k] = j
        gpus[k] = g
        degrees[k] = tp
        k += 1
        if j == L:
            free(current)
            free(upcoming)
            return k
        remaining -= stage_time(t, i, j, g, tp) + (t.comm_intra[j - 1] if u > g else t.comm_inter[j - 1])
        c = c if u > g else c - 1
        u = u - g if u > g else G
        i = j
        swap = current
        current = upcoming
        upcoming = swap


def search(const int64_t[:, ::1] time_pf, const int64_t[::1] state_pf, const int64_t[::1] act_pf,
           const int64_t[::1] rep_pf, const int64_t[::1] comm_intra, const int64_t[::1] comm_inter, int gpus,
           int max_dp, int max_tp, int max_nodes, int m_ref, int64_t memory, int64_t[::1] objective,
           int64_t[::1] peak, int32_t[::1] stages, int32_t[:, ::1] ends, int32_t[:, ::1] stage_gpus,
           int32_t[:, ::1] stage_tp):
    """Best template of every node count 1..max_nodes, written into the output arrays (row n = n nodes).

    A stage of g GPUs takes a tensor-parallel degree t (a power of two <= max_tp dividing g) such that its g / t
    groups split the microbatch evenly (g / t <= max_dp, both powers of two <= gpus). time_pf has one row per
    degree 1, 2, .., max_tp.

    Inputs are the integer tables of templates.cost_tables. objective/peak: in units of 1/G ns;
    stages[n] = 0 where no template of n nodes fits. Returns K, the position cap used (a diagnostic).
    """
    cdef int L = time_pf.shape[1] - 1, n, count
    cdef Tables t
    cdef Fronts fronts
    cdef StageTimes times
    cdef int64_t states
    cdef int status = 0
    for name, size, want in (("time_pf rows", time_pf.shape[0], max_tp.bit_length() if max_tp > 0 else 1),
                             ("state_pf", state_pf.shape[0], L + 1), ("act_pf", act_pf.shape[0], L + 1),
                             ("rep_pf", rep_pf.shape[0], L + 1),
                             ("comm_intra", comm_intra.shape[0], L), ("comm_inter", comm_inter.shape[0], L),
                             ("objective", objective.shape[0], max_nodes + 1), ("peak", peak.shape[0], max_nodes + 1),
                             ("stages", stages.shape[0], max_nodes + 1), ("ends", ends.shape[0], max_nodes + 1),
                             ("stage_gpus", stage_gpus.shape[0], max_nodes + 1), ("ends columns", ends.shape[1], L),
                             ("stage_gpus columns", stage_gpus.shape[1], L),
                             ("stage_tp", stage_tp.shape[0], max_nodes + 1), ("stage_tp columns", stage_tp.shape[1], L)):
        if size != want:
            raise ValueError(f"{name}: length {size}, expected {want} (L = {L}, max_nodes = {max_nodes})")
    if (L < 1 or gpus < 1 or gpus & (gpus - 1) or max_dp < 1 or max_dp & (max_dp - 1) or max_dp > gpus
            or max_tp < 1 or max_tp & (max_tp - 1) or max_tp > gpus or max_nodes < 1 or m_ref < 1 or memory <= 0):
        raise ValueError(
            f"invalid shape: L={L} gpus={gpus} max_dp={max_dp} max_tp={max_tp} max_nodes={max_nodes} m_ref={m_ref} "
            f"memory={memory}"
        )
    t.num_layers = L
    t.gpus = gpus
    t.max_dp = max_dp
    t.max_tp = max_tp
    t.max_gpus = max_dp * max_tp if max_dp * max_tp < gpus else gpus
    t.max_nodes = max_nodes if max_nodes < L else L  # more nodes than layers never fit: a node holds >= 1 layer
    t.m_ref = m_ref
    t.memory = memory
    t.time_pf = &time_pf[0, 0]
    t.state_pf = &state_pf[0]
    t.act_pf = &act_pf[0]
    t.rep_pf = &rep_pf[0]
    t.comm_intra = &comm_intra[0]
    t.comm_inter = &comm_inter[0]
    with nogil:
        t.positions = memory_cap(&t)
    states = <int64_t>L * t.max_nodes * gpus * t.positions
    times.levels = level(t.max_gpus) + 1 if max_tp > 1 else 0  # no table without tensor parallelism
    times.time = <int64_t*>malloc(max(1, <int64_t>times.levels * t.positions * (L + 1)) * sizeof(int64_t))
    times.reach = <int32_t*>malloc(max(1, <int64_t>times.levels * t.positions) * sizeof(int32_t))
    fronts.size = 0
    fronts.capacity = 4096
    fronts.pool = <Entry*>malloc(fronts.capacity * sizeof(Entry))
    fronts.offset = <int64_t*>malloc(states * sizeof(int64_t))
    fronts.count = <int32_t*>malloc(states * sizeof(int32_t))
    try:
        if fronts.pool == NULL or fronts.offset == NULL or fronts.count == NULL:
            raise MemoryError(f"template search: {states} suffix states do not fit in memory")
        if times.time == NULL or times.reach == NULL:
            raise MemoryError(f"template search: stage times of {times.levels} x {t.positions} x {L + 1} do not fit")
        with nogil:
            status = build_fronts(&t, &fronts, &times)
            if status == 0:
                for n in range(1, max_nodes + 1):
                    count = reconstruct(&t, &fronts, n, &objective[n], &peak[n], &ends[n, 0], &stage_gpus[n, 0],
                                        &stage_tp[n, 0])
                    if count < 0:
                        status = -2 - n
                        break
                    stages[n] = count
        if status == -1:
            raise MemoryError("template search: the Pareto fronts do not fit in memory")
        if status < -1:
            raise RuntimeError(f"template search: the walk for {-2 - status} nodes lost the optimum (a planner bug)")
    finally:
        free(fronts.pool)
        free(fronts.offset)
        free(fronts.count)
        free(times.time)
        free(times.reach)
    return t.positions
