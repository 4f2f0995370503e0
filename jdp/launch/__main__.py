"""`python -m jdp.launch`: see `jdp.launch`."""
from jdp.launch._cli import main

main()
