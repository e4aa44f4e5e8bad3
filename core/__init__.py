"""The ground floor: errors, the config, processes and signals, logs, start-up settings and every file write.

Imports nothing of the app outside itself; data/, models/ and engine/ stand on it.
"""
