"""``python -m gradstat`` runs the command line."""

from gradstat.cli.main import main

if __name__ == "__main__":
    main()
