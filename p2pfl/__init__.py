"""p2pfl: peer-to-peer personalized federated learning on Flower.

Importing the package sets one process-wide default before torch is loaded (it only takes effect
then): ``MKL_DISABLE_FAST_MM=1``. MKL's fast memory manager keeps a buffer cache per thread that
ran a GEMM (about 1 MB per thread after a linear layer's backward pass, measured with torch
2.14's MKL on some hosts) and frees it only when the thread ends. When a simulation worker ran
one thread per peer, at 64 peers per worker the caches were ~60 MB per worker, most of the
simulation's memory above the hand-written limit (``bench/many_peers.py``); its peers are now
greenlets of one thread (``p2pfl/turns.py``), but torch, the progress bar and a user's ClientApp
may start threads of their own. Without the cache each GEMM takes its
buffer from malloc; the bench measured no slowdown. An explicit ``MKL_DISABLE_FAST_MM`` in the
environment wins; a process that imported torch before p2pfl keeps MKL's default.
"""

import os

os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
