"""Executors: how the engine reaches the model runner of every tensor-parallel
rank (DESIGN.md §11). ``uni`` runs the one rank in this process, ``mp`` one
worker process per rank on this machine, ``ray`` one Ray actor per rank,
anywhere in a Ray cluster. The interface is ``vframe.core.interfaces.Executor``;
each rank's side is ``worker.Worker``."""
