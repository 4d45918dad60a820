"""The core runtime every layer builds on: the cluster model, the wire format, the transport contract
(and its factory), options, errors, the timeline recorder, and what a task records for its launcher
(job state, failures). Collectives, the launcher and the transport kit live in packages of their own."""
