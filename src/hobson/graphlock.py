"""One lock that keeps CUDA graph capture and the byte pool's CUDA calls apart.

The engine records a decode graph the first time it meets a batch shape, on the rollout's thread,
while the background checkpoint writer copies GPU tensors to the host on the pool's threads.
Capturing in ``thread_local`` mode tolerates most calls from other threads, but not one that
waits on the capturing stream (a device-wide synchronize), and what else a driver refuses
mid-capture (pinned-memory allocation, stream creation) is not a thing to find out in a run. So a
capture holds :data:`CAPTURE`, and so does each writer piece while it makes CUDA calls (take a
staging buffer, queue the copy, wait for it); its file write runs outside. A capture waits for at
most one 64 MiB copy (about a millisecond); the writer waits while a graph records (milliseconds).
"""

from __future__ import annotations

import threading

CAPTURE = threading.Lock()
