"""Timelines: where each task's training steps go, on one time axis (README: "Timeline").

- :mod:`stratagem.core.timeline` (the recorder, in core because every layer's hot paths call it):
  with ``STRATAGEM_TIMELINE=PATH``, each task records its steps' phases (compute, pack, collectives,
  ps pushes and pulls, waits on named peers, optimizer) and writes them when it ends;
- :mod:`stratagem.core.timeline_clock`: each task measures its clock's offset to the chief's over the
  transport (NTP-style), so tasks on different hosts line up;
- :mod:`~stratagem.timeline.merge`: the tasks' files become one Chrome-trace / Perfetto JSON;
- :mod:`~stratagem.timeline.summary`: per task, the step time breakdown and the waits on each peer,
  and the straggler.

``stratagem launch --timeline trace.json ...`` does all of it; ``stratagem timeline merge|summary``
works on files written under any launcher. The library's hot paths import only the recorder; this
package (reading, merging, summarising) is imported by the command line and ``launch --timeline``.
"""
