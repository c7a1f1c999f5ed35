# The compiled template search's declarations (the contract of _templates.pyx).
from libc.stdint cimport int32_t, int64_t


cdef struct Entry:
    # One Pareto-optimal suffix: `total` = sum of stage times + communication, `peak` = max stage time.
    int64_t total
    int64_t peak


cdef struct Tables:
    # Read-only inputs, prefix sums indexed by layer boundary 0..L.
    int num_layers
    int gpus                    # G
    int max_dp                  # the most ways a stage splits a microbatch (a power of two dividing it, <= G)
    int max_tp                  # the largest tensor-parallel degree t (a power of two <= G)
    int max_gpus                # the most GPUs of one stage: min(G, max_dp * max_tp)
    int max_nodes               # C: suffix states hold up to C - 1 whole nodes after the current one
    int m_ref
    int positions               # K: positions from the pipeline's end are capped at K (see memory_cap)
    int64_t memory
    const int64_t* time_pf      # [k * (L + 1) + l]: forward + backward ticks (ns) of one microbatch at t = 2**k
    const int64_t* state_pf
    const int64_t* act_pf
    const int64_t* rep_pf       # the part of act_pf tensor parallelism does not split
    const int64_t* comm_intra   # [l]: 2*C of the boundary after layer l inside a node, units
    const int64_t* comm_inter   # [l]: the same between nodes


cdef struct Fronts:
    # Pareto fronts of every suffix state, concatenated; state s owns pool[offset[s] : offset[s] + count[s]],
    # sorted by peak ascending (so total strictly descending).
    Entry* pool
    int64_t size
    int64_t capacity
    int64_t* offset
    int32_t* count


cdef struct StageTimes:
    # best_time of every stage starting at one layer i, for each GPU count 2**gk and position p <= K:
    # time[((gk * K + p - 1) * (L + 1)) + j], valid for j <= reach[gk * K + p - 1] (i when none fits).
    int64_t* time
    int32_t* reach
    int levels                  # GPU counts 1, 2, .., max_gpus; 0: no table (max_tp == 1, computed directly)


cdef struct Buffer:
    # The front under construction for one state (sorted by peak ascending, total strictly descending).
    Entry* data
    int64_t size
    int64_t capacity
