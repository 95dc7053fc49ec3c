from configparser import ConfigParser
import setuptools, shlex

# note: all settings are in settings.ini; edit there, not here
config = ConfigParser(delimiters=["="])
config.read("settings.ini", encoding="utf-8")
cfg = config["DEFAULT"]

cfg_keys = "version description keywords author author_email".split()
expected = cfg_keys + "lib_name user branch license status min_python audience language".split()
for o in expected:
    assert o in cfg, "missing expected setting: {}".format(o)
setup_cfg = {o: cfg[o] for o in cfg_keys}

licenses = {"apache2": "Apache-2.0", "mit": "MIT"}  # settings.ini's name -> SPDX expression
statuses = [
    "1 - Planning",
    "2 - Pre-Alpha",
    "3 - Alpha",
    "4 - Beta",
    "5 - Production/Stable",
    "6 - Mature",
    "7 - Inactive",
]
py_versions = "3.10 3.11 3.12 3.13".split()

requirements = shlex.split(cfg.get("requirements", ""))
if cfg.get("pip_requirements"):
    requirements += shlex.split(cfg.get("pip_requirements", ""))
min_python = cfg["min_python"]
lic = licenses.get(cfg["license"].lower(), cfg["license"])
dev_requirements = shlex.split(cfg.get("dev_requirements", ""))
logging_requirements = shlex.split(cfg.get("logging_requirements", ""))
plot_requirements = shlex.split(cfg.get("plot_requirements", ""))
widgets_requirements = shlex.split(cfg.get("widgets_requirements", ""))
tokenizers_requirements = shlex.split(cfg.get("tokenizers_requirements", ""))
datasets_requirements = shlex.split(cfg.get("datasets_requirements", ""))
hf_requirements = shlex.split(cfg.get("hf_requirements", ""))  # export and load with transformers

# The shipped configs live at the top level (configs/, examples/) and are installed inside the
# package as speedtronic.configs / speedtronic.examples (2.0 shipped them only in the sdist).
packages = setuptools.find_packages(include=[cfg["lib_name"], cfg["lib_name"] + ".*"])
packages += [cfg["lib_name"] + ".configs", cfg["lib_name"] + ".examples"]
package_dir = {cfg["lib_name"] + ".configs": "configs", cfg["lib_name"] + ".examples": "examples"}

setuptools.setup(
    name=cfg["lib_name"],
    license_expression=lic,  # SPDX; license classifiers are deprecated
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"].title(),
        "Natural Language :: " + cfg["language"].title(),
    ]
    + [
        "Programming Language :: Python :: " + o
        for o in py_versions[py_versions.index(min_python) :]
    ],
    url=cfg["git_url"],
    packages=packages,
    package_dir=package_dir,
    include_package_data=True,
    package_data={
        cfg["lib_name"] + ".configs": ["*.yaml"],
        cfg["lib_name"] + ".examples": ["*.yaml"],
    },
    install_requires=requirements,
    extras_require={
        "dev": dev_requirements,
        "logging": logging_requirements,
        "plot": plot_requirements,
        "widgets": widgets_requirements,
        "tokenizers": tokenizers_requirements,
        "datasets": datasets_requirements,
        "hf": hf_requirements,
    },
    dependency_links=cfg.get("dep_links", "").split(),
    python_requires=">=" + cfg["min_python"],
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    zip_safe=False,
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f"{cfg.get('lib_path')}={cfg.get('lib_path')}._modidx:d"],
    },
    **setup_cfg,
)
