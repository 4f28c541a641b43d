from plugserve.server.launch import main

main()
