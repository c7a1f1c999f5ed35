"""Type stub of the compiled instantiation core (planner_cy/_instantiate.pyx)."""

import numpy as np
import numpy.typing as npt

SOURCE_HASH: str

def max_pipelines(sizes: npt.NDArray[np.int64], n_nodes: int) -> int: ...
def pipeline_counts(sizes: npt.NDArray[np.int64], n_nodes: int, limit: int) -> npt.NDArray[np.bool_]: ...
def solve(
    sizes: npt.NDArray[np.int64],
    base: npt.NDArray[np.float64],
    slope: npt.NDArray[np.float64],
    most_each: npt.NDArray[np.int64],
    n_nodes: int,
    min_pipelines: int,
    microbatches: int,
    upper: float = ...,
) -> tuple[float, npt.NDArray[np.int64]] | None: ...
def split(
    base: npt.NDArray[np.float64], slope: npt.NDArray[np.float64], microbatches: int
) -> npt.NDArray[np.int64]: ...
def dominated(
    sizes: npt.NDArray[np.int64],
    base: npt.NDArray[np.float64],
    slope: npt.NDArray[np.float64],
    most_each: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]: ...
