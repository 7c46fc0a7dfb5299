"""Following a job's event stream and relaying it to a waiting client (docs/architecture.md,
"The api/ folder and its packages"): the one SSE relay (`relay`), the hub's readers
(`stream_hub`, `slot_routing`, `xread_replies`), the repair of a job that will send no
terminal event (`lost_jobs`) and the follow loop and its helpers (`events`)."""
