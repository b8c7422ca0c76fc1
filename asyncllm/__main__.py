from asyncllm.cli import main

main()
