# Sourced by tools/device/prepare_*_carry.sh (which define `fail`).
# unpack GIT_DIR COMMIT DEST PATH...: the PATHs of COMMIT as files under DEST. Every blob of the chosen trees
# must land there: a partial mirror lacks some large objects, and git archive then prints "invalid object"
# for those outside the chosen paths too, harmlessly; the count below is the check.
unpack() {
    local git_dir=$1 commit=$2 dest=$3
    shift 3
    mkdir -p "$dest"
    git -C "$git_dir" archive "$commit" -- "$@" | tar -x -C "$dest"
    local want have
    want=$(git -C "$git_dir" ls-tree -r "$commit" -- "$@" | awk '$2 == "blob"' | wc -l)
    have=$(find "$dest" -type f | wc -l)
    [ "$want" -eq "$have" ] || fail "$git_dir $commit: $have of $want files of $* unpacked"
}
