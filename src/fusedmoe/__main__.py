from fusedmoe.cli import main

if __name__ == "__main__":  # not in multiprocessing's spawned children
    raise SystemExit(main())
