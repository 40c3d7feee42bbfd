from moebench.cli.app import main

main()
