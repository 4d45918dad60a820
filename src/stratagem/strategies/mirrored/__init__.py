"""The ``mirrored`` strategy: :mod:`.strategy` (synchronous all-reduce replicas) and :mod:`.elastic`
(``on_failure="shrink"``: members that leave and come back).
"""
