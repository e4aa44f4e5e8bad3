"""The assembly floor: the one package that combines data/, models/ and engine/ into runs (start-up, parts, fit)
and the inference tools' model; the entry points parse arguments and make one call here."""
