# Shared by the launch scripts (sourced, not run): error exit and recipe lookup.

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

# A name looks the flagfile up inside the installed package, so the recipe
# always matches the code that reads it.
resolve_recipe() {
  local recipe=$1 path
  if [[ -f $recipe ]]; then
    printf '%s\n' "$recipe"
  elif [[ $recipe == */* || $recipe == *.flags ]]; then
    die "RECIPE=$recipe: no such file"
  else
    path=$("${PYTHON:-python3}" -c 'import importlib.resources as r, sys
print(r.files("distributed_mpt") / "recipes" / (sys.argv[1] + ".flags"))' "$recipe" 2>/dev/null) ||
      die "cannot import distributed_mpt with ${PYTHON:-python3}: install the package, set PYTHON=/path/to/its/python, or set RECIPE=/path/to/recipe.flags"
    [[ -f $path ]] || die "no recipe '$recipe' in the package (looked for $path); shipped recipes: resnet9, mlp"
    printf '%s\n' "$path"
  fi
}

# For the scripts that run the trainer on this host: sets recipe_path,
# MODEL_DIR and DATA_DIR from RECIPE, MODEL_DIR and DATA_DIR (defaults in
# each script's header) and checks that the trainer is installed.
local_run_defaults() {
  recipe_path=$(resolve_recipe "${RECIPE:-resnet9}")
  MODEL_DIR=${MODEL_DIR:-runs/cifar10-$(basename "$recipe_path" .flags)}
  DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
  command -v distributed-mpt-train >/dev/null ||
    die "distributed-mpt-train is not on PATH: install the package (pip install -e .) or activate its virtualenv"
}
