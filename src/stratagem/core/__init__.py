"""The core runtime: cluster model, wire format, transport contract, collectives, launcher."""
