"""Timelines: where each task's training steps go, on one time axis (README: "Timeline").

- :mod:`~stratagem.timeline.recorder`: with ``STRATAGEM_TIMELINE=PATH``, each task records its steps'
  phases (compute, pack, collectives, ps pushes and pulls, waits on named peers, optimizer) and
  writes them when it ends;
- :mod:`~stratagem.timeline.clock`: each task measures its clock's offset to the chief's over the
  transport (NTP-style), so tasks on different hosts line up;
- :mod:`~stratagem.timeline.merge`: the tasks' files become one Chrome-trace / Perfetto JSON;
- :mod:`~stratagem.timeline.summary`: per task, the step time breakdown and the waits on each peer,
  and the straggler.

``stratagem launch --timeline trace.json ...`` does all of it; ``stratagem timeline merge|summary``
works on files written under any launcher. This package imports nothing heavy: the hot paths of the
library import only :mod:`~stratagem.timeline.recorder`.
"""
