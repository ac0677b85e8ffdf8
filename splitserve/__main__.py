from splitserve.cli import main

main()
