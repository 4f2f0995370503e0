"""`python -m benchmarks [--output BENCHMARKS.md] [--quick] [--only JOB,...]`: the suite that
`make bench` runs (`benchmarks.harness.run`)."""
from benchmarks.harness.run import main

main()
