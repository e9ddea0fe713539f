"""The engine in a process of its own, and the handle that talks to it: shared by the HTTP server
(serve/) and offline data parallelism (data_parallel/), below both. messages.py is what the two
processes send each other."""
