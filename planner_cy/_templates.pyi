"""Type stub of the compiled template search (planner_cy/_templates.pyx)."""

import numpy as np
import numpy.typing as npt

SOURCE_HASH: str

def search(
    time_pf: npt.NDArray[np.int64],
    state_pf: npt.NDArray[np.int64],
    act_pf: npt.NDArray[np.int64],
    rep_pf: npt.NDArray[np.int64],
    comm_intra: npt.NDArray[np.int64],
    comm_inter: npt.NDArray[np.int64],
    gpus: int,
    max_dp: int,
    max_tp: int,
    max_nodes: int,
    m_ref: int,
    memory: int,
    objective: npt.NDArray[np.int64],
    peak: npt.NDArray[np.int64],
    stages: npt.NDArray[np.int32],
    ends: npt.NDArray[np.int32],
    stage_gpus: npt.NDArray[np.int32],
    stage_tp: npt.NDArray[np.int32],
) -> int:
    """Best template of every node count 1..max_nodes into the output arrays; returns the position cap K."""
