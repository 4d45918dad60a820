"""How a parameter server takes pushes (:mod:`stratagem.ps.server`): checks, the consistency
modes, the update, and the acknowledgements with the values they carry.

:class:`PushHandling` is a mixin of :class:`~stratagem.ps.server.ParameterServer`; it uses the
server's pieces (``specs``, ``values``), optimizer, step, counters, sync round and staleness gate, and
its ``_send``/``_send_part``/``_replace``. See the server's module doc for the modes:

- ``async``: applied and acknowledged at once; a push that asks for the values back is answered part
  by part as the update goes (:meth:`PushHandling._apply_streaming`).
- ``sync``: gradients for the current step are summed until ``replicas_to_aggregate`` replicas have
  pushed, then their weighted mean is applied and every contributor acknowledged; older ones dropped.
- ``bounded``: applied at once; the clock shard holds the acknowledgement of a replica too far ahead.

Row gradients (``IndexedSlices``) go through :mod:`stratagem.ps.rows`.
"""

from __future__ import annotations

from stratagem.core.cluster import TaskId
from stratagem.ps.buffers import takes_over
from stratagem.ps.consistency import StalenessGate, SyncRound
from stratagem.ps.protocol import APPLIED, DROPPED, STOPPED, RequestRefused, piece_shape, split_parts, task_key
from stratagem.ps.rows import apply_row_gradient, check_real, row_gradients
from stratagem.training.sparse import IndexedSlices
from stratagem.core import timeline as _timeline


class PushHandling:
    """Pushes and their acknowledgements (mixed into ``ParameterServer``)."""

    def _op_push(self, src, request_id, meta, buffers):
        who = task_key(src)
        if who not in self.members:          # an evaluator (or a ps task) never trains
            raise RequestRefused(f"{src} is not a replica ('chief' or 'worker' task): it may read the "
                                 f"variables but not push gradients")
        if self.config is None:
            raise RequestRefused(f"{self.task} has no variables yet: the chief must create them first")
        if self.optimizer is None:
            raise RequestRefused(f"{self.task} has no optimizer: send the optimizer's config first")
        names, buffers = self._gradients(meta, buffers)
        pull = self._wanted(meta)            # None: no values back; else the pieces to leave out
        self._idle.discard(who)
        self.counters["pushes"] += 1
        self.by_replica[who]["pushes"] += 1
        if self.stopping:
            return self._count(who, STOPPED, pull)
        mode = self.config["mode"]
        if mode == "sync":
            version = meta.get("version")
            if not isinstance(version, int) or version < self.step:
                return self._count(who, DROPPED, pull)
            if version > self.step:
                raise RequestRefused(f"push for step {version}, but {self.task} is at step {self.step}")
            weight = float(meta.get("weight", 1.0))
            self._round.add(who, names, buffers, weight, (src, request_id, pull))
            self._maybe_finish_round()
            return None  # answered when the round completes
        if mode == "async" and pull is not None and len(set(names)) == len(names):
            self._apply_streaming(src, request_id, who, names, buffers, pull)
            return None  # answered part by part
        self._apply(names, buffers)
        self.counters["updates"] += 1
        if mode == "bounded" and self.config.get("clock") == task_key(self.task):
            if self._gate is None:
                self._gate = StalenessGate(self.config["staleness"])
            self._gate.pushed(who, (src, request_id, pull))
            self._release_held()
            return None
        return self._count(who, APPLIED, pull)

    def _gradients(self, meta: dict, buffers: list) -> tuple[list[str], list]:
        """A push's pieces and gradients, checked: first the dense ones (``names``, one array each),
        then the row gradients (``rows``, two arrays each: int64 rows counted from the piece's first
        row, and their gradient), as :class:`~stratagem.training.sparse.IndexedSlices`."""
        names = self._names(meta.get("names") or [])
        rows = self._names(meta.get("rows") or [])
        if len(buffers) < len(names):
            raise RequestRefused(f"push: {len(names)} name(s) but {len(buffers)} gradient(s)")
        for name, grad in zip(names, buffers):
            self._check_value(self.specs[name], grad, "the gradient")
            check_real(name, grad)
        sparse = row_gradients(rows, [piece_shape(self.specs[n]) for n in rows], buffers[len(names):])
        return names + rows, list(buffers[:len(names)]) + sparse

    def _wanted(self, meta: dict) -> frozenset | None:
        """What a push's reply carries: ``None``, no values (``pull`` false); else the pieces *not* to
        send (``skip``: the tables the requester reads only by rows)."""
        if not meta.get("pull"):
            return None
        skip = meta.get("skip") or []
        if not isinstance(skip, list) or not all(isinstance(n, str) for n in skip):
            raise RequestRefused(f"push: skip must be a list of piece names, got {skip!r}")
        return frozenset(skip)

    def _reply_pieces(self, want: frozenset | None) -> list[str]:
        return [] if want is None else [n for n in self.specs if n not in want]

    def _count(self, who: str, status: str, pull: frozenset | None, extra: dict | None = None):
        """Count an acknowledgement; its reply. ``pull``: what the reply carries (:meth:`_wanted`)."""
        self.counters[status] += 1
        self.by_replica[who][status] += 1
        names = self._reply_pieces(pull) if status != STOPPED else []
        return ({"status": status, "names": names, **(extra or {}), **self._status()},
                [self.values[n] for n in names])

    def _apply(self, names: list[str], grads: list) -> None:
        """One optimizer step over ``names`` (no names: the step still counts, as for every shard)."""
        recorder = _timeline.RECORDER
        started = recorder.now() if recorder is not None else 0
        self.optimizer.iterations += 1
        for name, grad in zip(names, grads):
            self._update(name, grad)
        self.step += 1
        if recorder is not None:
            recorder.add("optimizer", "optimizer", started, recorder.now(), {"pieces": len(names)})

    def _update(self, name: str, grad) -> None:
        if isinstance(grad, IndexedSlices):   # rows: see ps_rows (exact rules in place, others densified)
            apply_row_gradient(self.optimizer, name, grad, self._replace, self._update)
            return
        optimizer = self.optimizer
        if takes_over(grad, self.values[name], optimizer):
            # The new values are written over the received gradient, which becomes the piece's
            # array: the old one is only read (a reply may still be sending it), no spare is written
            # (a quarter less memory traffic than updating into one), nothing waits.
            optimizer.update_array(name, self.values[name], grad, out=grad)
            self.values[name] = grad
            return
        self._replace(name, lambda old, target: optimizer.update_array(
            name, old, grad, out=None if target is old else target))

    def _apply_streaming(self, src: TaskId, request_id, who: str, names: list[str], grads: list,
                         want: frozenset) -> None:
        """An ``async`` push that asks for the values back: :meth:`_apply`, with the reply sent in
        parts, each as soon as its pieces are updated, so that the update of the next part overlaps
        the transfer of this one. No other request is handled in between, so every part carries the
        values of this step, as one reply would. Pieces the reply leaves out (``want``) are updated
        first."""
        recorder = _timeline.RECORDER
        started = recorder.now() if recorder is not None else 0
        pieces = self._reply_pieces(want)
        grad_of = dict(zip(names, grads))
        groups = [[pieces[i] for i in group] for group in split_parts([self.values[n].nbytes for n in pieces])]
        self.optimizer.iterations += 1
        sent = set(pieces)
        for name, grad in grad_of.items():
            if name not in sent:
                self._update(name, grad)
        sending = True
        for k, group in enumerate(groups):
            for name in group:
                if name in grad_of:
                    self._update(name, grad_of[name])
            if sending and k < len(groups) - 1:
                # A requester that is gone gets no more parts; the update still completes.
                sending = self._send_part(src, {"id": request_id, "names": group, "part": k, "parts": len(groups)},
                                          [self.values[n] for n in group])
        self.step += 1
        self.counters["updates"] += 1
        if recorder is not None:
            recorder.add("optimizer", "optimizer (reply streamed)", started, recorder.now(), {"pieces": len(names)})
        reply_meta, _ = self._count(who, APPLIED, None)
        if sending:
            last = {"names": groups[-1], "part": len(groups) - 1, "parts": len(groups)}
            self._send_part(src, {"id": request_id, "ok": True, **reply_meta, **last},
                            [self.values[n] for n in groups[-1]])

    # sync
    def _maybe_finish_round(self) -> None:
        round_ = self._round
        if not round_.count:
            return
        needed = min(self.config["replicas_to_aggregate"], max(1, len(self._active_pushers())))
        if round_.count < needed:
            return
        self._round = SyncRound()
        names, grads = round_.mean()
        self._apply(names, grads)
        self.counters["updates"] += 1
        for (src, request_id, pull), who in round_.waiters:
            reply_meta, values = self._count(who, APPLIED, pull)
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)

    # bounded
    def _release_held(self) -> None:
        if self._gate is None or not self._gate.held:
            return
        for (src, request_id, pull), who, clock, floor in self._gate.releasable(self._active_pushers()):
            reply_meta, values = self._count(who, APPLIED, pull, {"clock": clock, "min_clock": floor})
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)

    def _fail_waiters(self, error: str) -> None:
        """The job failed: every push still waiting (held by the staleness bound, or in a pending sync
        round, whose gradients are discarded) gets ``error`` instead of its acknowledgement."""
        waiting = [waiter for waiter, *_ in self._gate.release_all()] if self._gate is not None else []
        round_, self._round = self._round, SyncRound()
        waiting += [waiter for waiter, _ in round_.waiters]
        for src, request_id, _ in waiting:
            self._send(src, {"id": request_id, "error": error, "error_type": "RemoteError"})

    def _stop_waiters(self) -> None:
        """On stop: held bounded replies go out (their pushes were applied); a pending sync round is
        discarded (its pushes were not)."""
        if self._gate is not None:
            for (src, request_id, pull), who, clock in self._gate.release_all():
                reply_meta, values = self._count(who, APPLIED, pull, {"clock": clock})
                self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)
        round_, self._round = self._round, SyncRound()
        for (src, request_id, pull), who in round_.waiters:
            reply_meta, values = self._count(who, STOPPED, pull)
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)
