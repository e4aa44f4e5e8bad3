"""The checkpoint wing: every checkpoint read (formats), written (saver, sharded), checked and put back (resume),
the weights and model folders read from them, and the run folder they live in. Imports only core/.
"""
